"""Every use of a private torch name, in one place.

torch may rename or drop a private name in any release. Each one nbtools uses
is reached only through a function here, which falls back to public API (or
to nbtools' own code) when the name is gone, or raises
:class:`~nbtools.errors.UnsupportedTorchError` naming the torch version when
nothing can stand in for it. A fallback that costs speed is logged once, so a
slower reader is never silent. ``tests/test_torch_compat.py`` has one test per
name, run on every torch version in CI.

Tested torch versions: :data:`TESTED_TORCH` (the declared lower bound is its
first entry).

Names and what stands in for them:

- ``torch.distributed._state_dict_utils._create_cpu_state_dict`` /
  ``_copy_state_dict`` (reused host buffers of async saves): a plain-tensor
  copy; distributed tensors then raise.
- ``torch.utils.data._utils.pin_memory.pin_memory`` (pinning a batch): walks
  mappings and sequences and pins each tensor.
- ``torch.distributed.checkpoint.filesystem._StorageInfo`` (the per-item record
  of DCP's file format, which checkpoints must carry to load in PyTorch's own
  reader): no stand-in; raises.
- ``torch.distributed.checkpoint._extension`` (stream extensions such as
  ``ZStandard``): no stand-in; only checkpoints written with an extension need
  it, and they raise.
- ``UntypedStorage._checkpoint_offset`` and ``torch._C.PyTorchFileReader``
  (where a saved tensor's bytes start, and their byte order; reading tensors
  straight into place): the saved record is located with ``zipfile``; failing
  that, tensors are loaded with ``torch.load`` (slower; logged once).
- ``DataLoader._iterator`` and ``_shutdown_workers`` (a loader's live worker
  iterator, and stopping its workers): no iterator is seen (workers are then
  stopped by dropping it, as torch's own finaliser does).
- ``torch.distributed.init_process_group`` (and ``distributed_c10d``'s), replaced
  in a rank by a shim that skips a user's own call once the group is up: no
  stand-in needed, the shim wraps whatever torch has.
- ``multiprocessing.context._default_context`` (not torch's: the interpreter's
  own default start method, read without fixing it): ``fork`` is assumed.
- ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (where a
  DTensor's local shard starts in its global tensor, kept in a memory snapshot's
  record): no stand-in; the record then holds no offset (logged once), and a restore
  onto the same mesh does not need it.
- torch's restricted unpickler of ``.metadata``
  (``torch.distributed.checkpoint.filesystem._restricted_metadata_load``, with
  ``add_safe_metadata_globals``): used where torch has it; else nbtools' own.
"""

from __future__ import annotations

import collections.abc
import functools
import logging
import zipfile
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

from nbtools._internal.log import get_logger
from nbtools.errors import UnsupportedTorchError

__all__ = [
    "TESTED_TORCH",
    "create_cpu_state_dict",
    "copy_state_dict",
    "pin_memory",
    "narrow_tensor_by_index",
    "storage_info_class",
    "extension_registry",
    "stream_transform_extension_class",
    "storage_data_offset",
    "saved_byteorder",
    "loader_iterator",
    "take_loader_iterator",
    "shutdown_workers",
    "torch_metadata_loader",
    "guard_init_process_group",
    "restore_fork_start_method",
    "release_returned",
    "abort_groups",
    "dtensor_shard_offset",
]

#: torch versions the test suite runs on (CPU in CI); the first is the declared minimum.
TESTED_TORCH = ("2.9", "2.13")

_log = get_logger("torch")


def _missing(what: str, used_for: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"torch {torch.__version__} has no {what}, which nbtools needs for {used_for}. nbtools "
        f"is tested with torch {', '.join(TESTED_TORCH)}: install one of those "
        f"(pip install 'torch>={TESTED_TORCH[0]}')"
    )


@functools.cache
def _fallback_note(what: str, effect: str, level: int = logging.WARNING) -> None:
    """Log once that a private torch name is gone and what nbtools does instead
    (a warning when that costs speed or a feature, else at info level)."""
    _log.log(
        level,
        "torch %s has no %s; %s. nbtools is tested with torch %s",
        torch.__version__,
        what,
        effect,
        ", ".join(TESTED_TORCH),
    )


def _lookup(module: str, name: str) -> Any:
    """``module.name`` or None when the module or the name is gone."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# --- state dict buffers of async saves ---------------------------------------------------


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise _missing(
            "torch.distributed._state_dict_utils",
            f"staging a {type(tensor).__name__} (a distributed tensor) for an async save",
        )
    return tensor


def _own_create(obj: Any, pin: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        src = _plain(obj)
        return torch.empty(src.size(), dtype=src.dtype, device="cpu", pin_memory=pin)
    if isinstance(obj, dict):
        return {k: _own_create(v, pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_create(v, pin) for v in obj)
    return obj


def _own_copy(src: Any, dst: Any, non_blocking: bool) -> Any:
    if isinstance(src, torch.Tensor):
        dst.copy_(_plain(src).detach(), non_blocking=non_blocking)
        return dst
    if isinstance(src, dict):
        return {k: _own_copy(v, dst[k], non_blocking) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        return type(src)(_own_copy(v, d, non_blocking) for v, d in zip(src, dst, strict=True))
    return src


def create_cpu_state_dict(state_dict: dict[str, Any], pin_memory: bool) -> dict[str, Any]:
    """Host buffers shaped like ``state_dict``'s tensors (pinned with ``pin_memory``)."""
    create = _lookup("torch.distributed._state_dict_utils", "_create_cpu_state_dict")
    if create is None:
        _fallback_note("torch.distributed._state_dict_utils", "staging copies plain tensors only")
        return _own_create(state_dict, pin_memory)
    return create(state_dict, pin_memory=pin_memory)


def copy_state_dict(
    state_dict: dict[str, Any], buffers: dict[str, Any], non_blocking: bool
) -> dict[str, Any]:
    """``state_dict`` with every tensor copied into its buffer from :func:`create_cpu_state_dict`."""
    copy = _lookup("torch.distributed._state_dict_utils", "_copy_state_dict")
    if copy is None:
        _fallback_note("torch.distributed._state_dict_utils", "staging copies plain tensors only")
        return _own_copy(state_dict, buffers, non_blocking)
    return copy(state_dict, buffers, non_blocking=non_blocking, type_check=False)


# --- data loading ----------------------------------------------------------------------


def _own_pin(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        return type(data)({k: _own_pin(v) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_own_pin(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_own_pin(v) for v in data)
    if hasattr(data, "pin_memory"):
        return data.pin_memory()
    return data


def pin_memory(data: Any, device: str | None = None) -> Any:
    """``data`` (a batch: tensors in mappings and sequences) with every tensor pinned
    (for ``device``, as the ``DataLoader`` argument ``pin_memory_device`` says)."""
    pin = _lookup("torch.utils.data._utils.pin_memory", "pin_memory")
    if pin is None:
        _fallback_note("torch.utils.data._utils.pin_memory", "batches are pinned by nbtools")
        return _own_pin(data)
    return pin(data, device)


def loader_iterator(loader: Any) -> Any:
    """The live multi-process iterator a ``DataLoader`` keeps (persistent workers), or None."""
    if "_iterator" not in vars(loader):
        _fallback_note("DataLoader._iterator", "live loader workers are not seen")
        return None
    return vars(loader)["_iterator"]


def take_loader_iterator(loader: Any) -> Any:
    """Detach and return the loader's live iterator (None when none); the next
    ``iter(loader)`` starts new workers."""
    iterator = loader_iterator(loader)
    if iterator is not None:
        loader._iterator = None
    return iterator


def shutdown_workers(iterator: Any) -> None:
    """Stop the worker processes of a loader iterator and wait for them."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        _fallback_note(
            "_MultiProcessingDataLoaderIter._shutdown_workers",
            "loader workers stop when their iterator is collected",
        )
        return
    shutdown()


# --- distributed tensors ------------------------------------------------------------------


def dtensor_shard_offset(tensor: Any) -> list[int] | None:
    """Where a DTensor's local shard starts in its global tensor, per dimension.

    None where torch cannot say: the helper is gone from this torch release, or the
    placements are ones it does not describe.
    """
    compute = _lookup("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    if compute is None:
        _fallback_note(
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
            "memory snapshots of DTensor state record no shard offsets",
            logging.INFO,
        )
        return None
    try:
        _, offset = compute(tensor.shape, tensor.device_mesh, tensor.placements)
    except (RuntimeError, ValueError, TypeError, NotImplementedError, AssertionError) as exc:
        _log.debug("no shard offset for a DTensor with placements %s: %s", tensor.placements, exc)
        return None
    return [int(o) for o in offset]


# --- elastic process contexts -----------------------------------------------------------


def abort_groups() -> None:
    """Abort every process group of this process, the default one included, and forget them.

    Unlike ``destroy_process_group``, which only drops torch's references (a group
    still referenced elsewhere, by a traceback's frames or a manager, keeps its
    sockets open), an abort closes the connections at once, so a peer blocked in a
    collective with this process fails at once too. Falls back to the destroy.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
            return
        except (RuntimeError, ValueError, AttributeError) as exc:
            _log.debug("aborting the process groups failed (%s); destroying them", exc)
    else:
        _fallback_note(
            "torch.distributed.distributed_c10d._abort_process_group",
            "peers blocked in a collective with a healing rank fail only once it is collected",
            logging.INFO,
        )
    dist.destroy_process_group()


def release_returned(ctx: Any) -> None:
    """Let a ``MultiprocessContext``'s processes that returned exit without its ``wait``.

    Each one waits, after handing torch its return value, until torch's poll has read
    them all, which it never does for a context one of whose processes died (a group
    that healed in place goes by its own files instead).
    """
    event = getattr(ctx, "_worker_finished_event", None)
    if event is None:
        _fallback_note(
            "MultiprocessContext._worker_finished_event",
            "the ranks of a healed group end when they are stopped",
            logging.INFO,
        )
        return
    event.set()


def process_exitcodes(ctx: Any) -> dict[int, int | None]:
    """Exit codes of a ``MultiprocessContext``'s processes by local rank (None: running).

    torch's own ``wait`` reports one failed process (the first it finds), which
    may be a peer that failed in a collective after the process that really
    died; the launcher reads every exit code to name the right one. ``{}`` where
    torch keeps its processes elsewhere (the launcher then goes by torch's report).
    """
    processes = getattr(getattr(ctx, "_pc", None), "processes", None)
    if processes is None:
        _fallback_note(
            "MultiprocessContext._pc.processes",
            "a rank that died is named only when torch reports it first",
            logging.INFO,
        )
        return {}
    return {rank: process.exitcode for rank, process in enumerate(processes)}


# --- a rank's process --------------------------------------------------------------------


def guard_init_process_group(active_backend: str, on_skip: Callable[[str, str], None]) -> None:
    """Make ``torch.distributed.init_process_group`` a no-op once the default group is up.

    The first call that asks for a backend ``active_backend`` does not cover
    (``nccl`` in CPU ranks) calls ``on_skip(requested, active_backend)`` once.
    Before the group exists the call goes to torch's own function, unchanged.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.init_process_group
    if getattr(original, "_nbtools_guard", False):
        return
    told: list[bool] = []

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not c10d.is_initialized():
            return original(*args, **kwargs)
        requested = kwargs.get("backend", args[0] if args else None)
        if requested and not told and not _backends_covered(str(requested), active_backend):
            told.append(True)
            on_skip(str(requested), active_backend)
        return None

    init_process_group._nbtools_guard = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _backends_covered(requested: str, active: str) -> bool:
    """Whether every backend in ``requested`` ("nccl", "cuda:nccl,cpu:gloo") is active."""

    def names(spec: str) -> set[str]:
        return {part.split(":")[-1].strip().lower() for part in spec.split(",") if part.strip()}

    return names(requested) <= names(active)


def restore_fork_start_method() -> None:
    """Make ``multiprocessing``'s default start method in this process what a notebook has: fork.

    The forkserver sets its children's start method to ``forkserver`` for good
    (``set_start_method(..., force=True)``), which makes every process a rank's
    code starts (DataLoader workers above all, also those built by HF Trainer,
    accelerate or Lightning) pickle its target: a dataset class from a notebook
    cell then fails with "Can't pickle <class '__main__.X'>".

    The choice is reset rather than forced, so a user's own
    ``multiprocessing.set_start_method("spawn")`` (or torch's hint
    ``set_start_method("fork")``) still works as in a notebook. Where the
    interpreter's own default is not ``fork`` (Python 3.14 and later), ``fork``
    is chosen explicitly, because that is what notebook users of torch's loader
    workers rely on.

    Why forking here is CUDA-safe enough: the rank itself never forks its
    parent's CUDA state (it was started from the forkserver); what forks now are
    the rank's own children. Forked loader workers that never touch CUDA are
    the configuration torch users run every day on GPU ranks under torchrun; a
    worker that does need CUDA must ask for ``spawn`` explicitly, as it would in
    any torchrun script.
    """
    import multiprocessing
    import multiprocessing.context

    if "fork" not in multiprocessing.get_all_start_methods():
        return  # not Linux/Unix: keep what the platform does
    multiprocessing.set_start_method(None, force=True)
    if _platform_start_method() != "fork":
        multiprocessing.set_start_method("fork", force=True)


def _platform_start_method() -> str:
    # The default context's own choice, read without fixing it (get_start_method would).
    import multiprocessing.context

    ctx = getattr(multiprocessing.context, "_default_context", None)
    default = getattr(ctx, "_default_context", None)
    name = getattr(default, "_name", None)
    if name is None:
        _fallback_note(
            "multiprocessing.context._default_context",
            "fork is assumed to be the platform's start method",
            logging.INFO,
        )
        return "fork"
    return name


# --- DCP file format --------------------------------------------------------------------


def narrow_tensor_by_index(
    tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """The part of ``tensor`` at ``offsets`` of ``sizes`` (a view), as DCP's readers take it.

    Written with public ops (torch's own is ``torch.distributed._shard._utils``).
    """
    out = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=False)):
        if size < tensor.size(dim):
            out = out.narrow(dim, offset, size)
    return out


def storage_info_class() -> type:
    """``_StorageInfo``: the per-item record (file, offset, length) of DCP's file format."""
    cls = _lookup("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    if cls is None:
        raise _missing("torch.distributed.checkpoint.filesystem._StorageInfo", "DCP shard files")
    return cls


def extension_registry() -> Any:
    """A new ``ExtensionRegistry`` of DCP stream extensions (``ZStandard``, ...)."""
    cls = _lookup("torch.distributed.checkpoint._extension", "ExtensionRegistry")
    if cls is None:
        raise _missing(
            "torch.distributed.checkpoint._extension",
            "reading checkpoints written with stream extensions (FileSystemWriter(_extensions=))",
        )
    return cls()


def stream_transform_extension_class() -> type:
    """``StreamTransformExtension``, the base class of DCP's stream extensions."""
    cls = _lookup("torch.distributed.checkpoint._extension", "StreamTransformExtension")
    if cls is None:
        raise _missing(
            "torch.distributed.checkpoint._extension",
            "reading checkpoints written with stream extensions (FileSystemWriter(_extensions=))",
        )
    return cls


def _zip_record(stream: IO[bytes], suffix: str) -> zipfile.ZipInfo | None:
    stream.seek(0)
    with zipfile.ZipFile(stream) as archive:
        for info in archive.infolist():
            if info.filename.endswith(suffix):
                return info
    return None


def _zip_data_offset(stream: IO[bytes], info: zipfile.ZipInfo) -> int | None:
    """Where the data of a stored (uncompressed) zip member starts in ``stream``."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    stream.seek(info.header_offset)
    header = stream.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def storage_data_offset(saved: torch.Tensor, record: IO[bytes]) -> int | None:
    """Where the bytes of ``saved``'s storage start in its ``torch.save`` record ``record``.

    ``saved`` was loaded from ``record`` with ``map_location="meta"`` (no data read).
    None when it cannot be told (the caller then loads the tensor normally).
    """
    offset = getattr(saved.untyped_storage(), "_checkpoint_offset", None)
    if isinstance(offset, int):
        return offset
    _fallback_note(
        "UntypedStorage._checkpoint_offset on meta loads",
        "saved tensors are located with zipfile",
        logging.INFO,
    )
    try:
        info = _zip_record(record, "/data/0")
        return None if info is None else _zip_data_offset(record, info)
    except (zipfile.BadZipFile, OSError, ValueError):
        return None


def saved_byteorder(record: IO[bytes]) -> str | None:
    """The byte order (``"little"``/``"big"``) recorded in a ``torch.save`` record;
    None when it records none (files of old torch versions: native order)."""
    reader_cls = getattr(torch._C, "PyTorchFileReader", None)
    if reader_cls is not None:
        reader = reader_cls(record)
        if not reader.has_record("byteorder"):
            return None
        return reader.get_record("byteorder").decode()
    _fallback_note(
        "torch._C.PyTorchFileReader", "the byte order is read with zipfile", logging.INFO
    )
    info = _zip_record(record, "/byteorder")
    if info is None:
        return None
    record.seek(0)
    with zipfile.ZipFile(record) as archive:
        return archive.read(info).decode()


# --- DCP metadata -------------------------------------------------------------------------


def torch_metadata_loader() -> Callable[[IO[bytes]], Any] | None:
    """torch's own restricted ``.metadata`` unpickler, where this torch has one, else None.

    torch releases that restrict ``FileSystemReader``'s metadata unpickling
    expose ``add_safe_metadata_globals`` next to the loader.
    """
    module = "torch.distributed.checkpoint.filesystem"
    if _lookup(module, "add_safe_metadata_globals") is None:
        return None
    return _lookup(module, "_restricted_metadata_load")
