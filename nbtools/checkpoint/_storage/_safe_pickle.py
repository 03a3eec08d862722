"""Reading DCP ``.metadata`` without running code from the checkpoint.

PyTorch's ``FileSystemReader`` loads ``.metadata`` with plain ``pickle.load``,
so a crafted file on a shared volume runs code in every process that restores
it. The unpickler here admits only the types DCP metadata is made of; anything
else raises :class:`~nbtools.errors.UnsafeCheckpointError` before it is
called.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any

from nbtools import _torch_compat
from nbtools.checkpoint._storage._layout import METADATA_NAME, RANK_METADATA_RE
from nbtools.checkpoint._storage._target import Target
from nbtools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["load_metadata", "read_metadata", "check_weights_only"]

# Classes by (module, name). Dataclasses and enums of DCP metadata only: their
# constructors and ``__setstate__`` set attributes and nothing else.
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch", "Size"),
        ("torch._utils", "_get_layout"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeCheckpointError(
            f"checkpoint metadata asks to load {module}.{name}, which is not part of DCP "
            "metadata; refusing to unpickle it (a crafted .metadata can run code this way). "
            "Delete the checkpoint or restore from one you trust."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            "checkpoint metadata uses pickle persistent ids, which DCP metadata never does; "
            "refusing to unpickle it"
        )


def _load_with_torch(torch_loader: Any, data: bytes) -> Any:
    try:
        return torch_loader(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - classified below
        refused = exc
    # The unpickler here says whether the file is unsafe or merely damaged; it runs nothing
    # outside the allowed set either.
    _MetadataUnpickler(io.BytesIO(data)).load()
    raise UnsafeCheckpointError(
        f"torch's restricted metadata unpickler refused it ({type(refused).__name__}: "
        f"{refused}); allow a type there with "
        "torch.distributed.checkpoint.filesystem.add_safe_metadata_globals([...])"
    )


def load_metadata(data: bytes, where: str = ".metadata") -> Any:
    """Unpickle DCP metadata, admitting only DCP metadata types.

    Args:
        data: The bytes of a ``.metadata`` file.
        where: The file's location, for error messages.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata`` object.

    Raises:
        UnsafeCheckpointError: The file names a type outside the allowed set.
        CorruptCheckpointError: The file is truncated, garbage or not DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    torch_loader = _torch_compat.torch_metadata_loader()
    try:
        if torch_loader is None:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        else:
            metadata = _load_with_torch(torch_loader, data)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - every unpickling failure means "unreadable"
        raise CorruptCheckpointError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}); the save that wrote it "
            "did not finish or the file was damaged"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


def check_weights_only(data: bytes | memoryview, where: str) -> None:
    """Raise :class:`UnsafeCheckpointError` unless ``torch.load(weights_only=True)`` accepts ``data``.

    ``io.BytesIO`` values (which DCP saves for ``io.BytesIO`` state) are accepted too.

    DCP's default load planner unpickles non-tensor values with
    ``weights_only=False``; checking first keeps a crafted value from running code.
    """
    import torch

    # DCP saves an ``io.BytesIO`` value of a state dict as a pickled BytesIO; rebuilding
    # one only copies bytes, so it is admitted with the types weights_only allows.
    allow = getattr(torch.serialization, "safe_globals", None)
    try:
        with allow([io.BytesIO]) if allow is not None else contextlib.nullcontext():
            torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where}: a saved value needs a type that torch.load(weights_only=True) does not "
            f"allow ({str(exc).splitlines()[0]}). Keep saved state to plain Python data and "
            "tensors, or allow the type with torch.serialization.add_safe_globals([...])"
        ) from None
    except Exception as exc:  # noqa: BLE001
        raise CorruptCheckpointError(f"{where}: a saved value cannot be read ({exc})") from None


def read_metadata(target: Target, where: str, name: str = METADATA_NAME) -> Any:
    """Read and safely unpickle the metadata file ``name`` of a checkpoint directory target."""
    try:
        data = target.read_bytes(name)
    except FileNotFoundError:
        if name == METADATA_NAME:
            rank_local = sorted(n for n in target.listdir() if RANK_METADATA_RE.match(n))
            hint = (
                f" (it holds the rank-local metadata {', '.join(rank_local[:4])}: it was saved "
                "with use_collectives=False, so load it on as many ranks, each reading its own)"
                if rank_local
                else ""
            )
            raise CheckpointNotFoundError(
                f"{where} has no {METADATA_NAME}: it is not a complete checkpoint{hint}"
            ) from None
        raise CheckpointNotFoundError(
            f"{where} has no {name}: no rank-local checkpoint of this rank is there (it was "
            "saved by fewer ranks, or with use_collectives=True, or not completely)"
        ) from None
    return load_metadata(data, f"{where}/{name}")
