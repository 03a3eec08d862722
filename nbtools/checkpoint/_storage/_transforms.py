"""Stream extensions of DCP checkpoints (``FileSystemWriter(_extensions=[...])``).

PyTorch records the extensions an item was written through (for example
``ZStandard`` compression) as ``transform_descriptors`` on the item's storage
info. Reading applies them, in the recorded order, through PyTorch's own
``ExtensionRegistry``, exactly as ``FileSystemReader`` does. A descriptor the
registry cannot turn into an extension (unknown name, or its module is not
installed) is refused before any data is read, naming the extension.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import IO, Any, cast

from nbtools import _torch_compat
from nbtools.errors import CheckpointError, CorruptCheckpointError

__all__ = ["StreamTransforms", "descriptors_of"]


def descriptors_of(info: Any) -> tuple[str, ...]:
    """The transform descriptors recorded for an item's storage info (empty when none)."""
    return tuple(getattr(info, "transform_descriptors", None) or ())


class StreamTransforms:
    """Applies the stream extensions recorded in a checkpoint to its item streams.

    Args:
        registry: A ``torch.distributed.checkpoint._extension.ExtensionRegistry``
            (holding extensions registered by the user); None: PyTorch's default one.
    """

    def __init__(self, registry: Any = None) -> None:
        self._registry = registry
        self._checked: set[tuple[str, ...]] = set()

    def _get_registry(self) -> Any:
        if self._registry is None:
            self._registry = _torch_compat.extension_registry()
        return self._registry

    def check(self, infos: Iterable[Any], where: str) -> None:
        """Refuse, before anything is read, extensions that cannot be applied here.

        Raises:
            CheckpointError: An item names an extension the registry does not know,
                or whose implementation is unavailable (the message names it).
        """
        for descriptors in {descriptors_of(info) for info in infos}:
            if descriptors and descriptors not in self._checked:
                self._extensions(descriptors, where)
                self._checked.add(descriptors)

    def _extensions(self, descriptors: Sequence[str], where: str) -> list[Any]:
        registry = self._get_registry()
        out = []
        for descriptor in descriptors:
            try:
                out.extend(registry.from_descriptor_list([descriptor]))
            except Exception as exc:  # the registry raises what its extension raises
                raise CheckpointError(
                    f"{where} was written with the stream extension {descriptor!r}, which "
                    f"cannot be applied here ({type(exc).__name__}: {exc}). Install the "
                    "module it needs (for 'stream.zstd': zstandard or pyzstd), or pass "
                    "VolumeReader(_extension_registry=...) with the extension registered"
                ) from exc
        return out

    def wrap(self, raw: IO[bytes] | io.RawIOBase, info: Any, where: str) -> IO[bytes]:
        """``raw`` (the item's stored bytes) read through the item's extensions."""
        base: type[Any] = _torch_compat.stream_transform_extension_class()
        # A RawIOBase is a binary file; typeshed's IO is a nominal class it does not derive from.
        stream = cast(IO[bytes], raw)
        for ext in self._extensions(descriptors_of(info), where):
            if isinstance(ext, base):
                stream = ext.transform_from(stream)
        return stream

    def read_all(self, raw: IO[bytes] | io.RawIOBase, info: Any, where: str) -> bytes:
        """The item's bytes after its extensions were applied.

        Raises:
            CheckpointError: The stored bytes cannot be decoded by the extensions.
        """
        try:
            stream = self.wrap(raw, info, where)
            out = io.BytesIO()
            while True:
                chunk = stream.read(4 << 20)
                if not chunk:
                    break
                out.write(chunk)
        except CheckpointError:
            raise
        except Exception as exc:  # any decoding failure means the same
            raise CorruptCheckpointError(
                f"{where}: the stored bytes cannot be decoded by the stream extensions "
                f"{list(descriptors_of(info))} ({type(exc).__name__}: {exc})"
            ) from exc
        return out.getvalue()
