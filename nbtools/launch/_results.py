"""A rank's return value, serialized once: pickle protocol 5 with out-of-band buffers.

The rank pickles its value once, keeping the large buffers (CPU tensors and
NumPy arrays) beside the pickle instead of inside it. A plain call's rank
writes them to a file in the launch's private run directory (:func:`dump`);
the caller maps that file and unpickles with the buffers in place. Neither side
copies a large value through a pipe, and torch's elastic result queue carries
only a small marker. A pool's rank sends them on its channel as they are
(:func:`pack`; the channel frames out-of-band buffers as separate parts).

File layout: ``NBR1``, the number of parts (8 bytes), each part's length (8
bytes each), then the parts, each at an offset aligned to 64 bytes: the pickle
first, then the buffers in order.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import pickle
import struct
import threading
import types
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Framed",
    "pack",
    "dump",
    "write",
    "framed_size",
    "load",
    "result_path",
    "out_of_band",
    "find_unpicklable",
    "unpicklable_message",
]

#: Where CUDA tensors in a rank's return value arrive, ``"cpu"`` (the default: the caller,
#: usually a notebook kernel, never creates a CUDA context to receive them) or ``"cuda"``:
#: set in every rank from the call's ``results_device`` (``_rank.setup_environment``).
_RESULTS_DEVICE_ENV = "NBTOOLS_RESULTS_DEVICE"

_MAGIC = b"NBR1"
_LEN = struct.Struct("<Q")
# Smaller buffers stay in the pickle: framing them costs more than it saves.
_MIN_OUT_OF_BAND = 64 * 1024
_ALIGN = 64
# Files at least this large are mapped instead of read.
_MAP_AT_LEAST = 1024 * 1024


def _padding(offset: int) -> int:
    return -offset % _ALIGN


@dataclass(frozen=True)
class Framed:
    """A pickle and its out-of-band buffers, as read back from a rank's result file."""

    data: bytes | memoryview
    #: Read back: memoryviews or bytearrays. Made by :func:`pack`: ``pickle.PickleBuffer``
    #: objects over the value's own memory, which a protocol 5 pickle sends out of band.
    buffers: list[Any] = field(default_factory=list)

    def loads(self) -> Any:
        """The value (``pickle.loads`` with the buffers)."""
        return pickle.loads(self.data, buffers=self.buffers)


def result_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` leaves its return value for the caller."""
    return os.path.join(run_dir, f"result-rank{rank}.pkl")


def _rebuild_tensor(buffer: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch

    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _to_host(tensor: Any) -> Any:
    """A copy of a CUDA tensor in host memory, keeping whether it requires grad."""
    moved = tensor.detach().to("cpu")
    if tensor.requires_grad:
        moved.requires_grad_(True)
    return moved


def _reduce_tensor(tensor: Any) -> Any:
    import torch

    if tensor.device.type == "cuda" and os.environ.get(_RESULTS_DEVICE_ENV, "cpu") != "cuda":
        tensor = _to_host(tensor)
    if (
        type(tensor) is not torch.Tensor
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.nbytes < _MIN_OUT_OF_BAND
    ):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return _rebuild_tensor, (pickle.PickleBuffer(raw.numpy()), tensor.dtype, tuple(tensor.shape))


_PICKLER: type | None = None


def _pickler_class() -> type:
    global _PICKLER
    if _PICKLER is None:
        _PICKLER = _new_pickler_class()
    return _PICKLER


def _new_pickler_class() -> type:
    import cloudpickle

    own: dict[type, Callable[[Any], Any]] = {}
    try:
        import torch

        # Keyed by exact type: a Parameter or another subclass keeps torch's own reduction.
        own[torch.Tensor] = _reduce_tensor
    except ImportError:  # pragma: no cover - ranks always have torch
        pass

    class _ResultPickler(cloudpickle.Pickler):
        # In front of cloudpickle's own table, never instead of it: classes, functions and
        # code defined in a cell travel by value as cloudpickle carries them.
        dispatch_table = ChainMap(own, cloudpickle.Pickler.dispatch_table)

    return _ResultPickler


def find_unpicklable(value: Any, root: str = "result") -> str | None:
    """Where inside ``value`` the part that cannot be pickled sits, e.g. ``result["model"].lock``.

    Walks dicts, lists, tuples, sets and objects' attributes (an ``nn.Module``'s
    submodules included) down to the innermost part that fails alone. Returns
    None when every part pickles alone (the value fails as a whole).
    """
    if _pickles(value):
        return None
    path, current = root, value
    for _ in range(_MAX_DEPTH):
        for step, child in _children(current):
            if not _pickles(child):
                path, current = path + step, child
                break
        else:
            break
    return f"{path} ({_kind(current)})"


def unpicklable_message(result: object, rank: int, exc: BaseException) -> str:
    """Why rank ``rank``'s return value cannot travel, naming the part inside it that fails."""
    where = find_unpicklable(result)
    part = f"{where} cannot be pickled" if where else "it cannot be pickled"
    return (
        f"the return value of rank {rank} ({type(result).__qualname__}) cannot be sent back to "
        f"the caller: {part} ({type(exc).__name__}: {exc}). Leave such parts out of what the "
        "function returns (return the model's state_dict(), or drop the lock or open file)."
    )


_MAX_DEPTH = 12


def _pickles(value: Any) -> bool:
    try:
        _pickler_class()(io.BytesIO(), protocol=5, buffer_callback=lambda b: False).dump(value)
    except Exception:  # noqa: BLE001 - pickling raises many types
        return False
    return True


def _children(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [(f" item {v!r}"[:60], v) for v in value]
    try:
        attrs = dict(vars(value))
    except TypeError:
        return []
    children = []
    for name, child in attrs.items():
        if name in ("_modules", "_parameters", "_buffers") and isinstance(child, dict):
            # An nn.Module's submodules, parameters and buffers read as its attributes.
            children += [(f".{k}", v) for k, v in child.items() if v is not None]
        else:
            children.append((f".{name}", child))
    return children


def _kind(value: Any) -> str:
    if isinstance(value, (type(threading.Lock()), type(threading.RLock()))):
        return "a lock"
    if isinstance(value, io.IOBase):
        return "an open file"
    if isinstance(value, types.GeneratorType):
        return "a generator"
    return f"a {type(value).__qualname__}"


def out_of_band(buffers: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
    """A protocol 5 ``buffer_callback`` that keeps large buffers out of the pickle, in ``buffers``.

    Small and non-contiguous buffers stay in band (framing them costs more than it saves).
    """

    def keep(buffer: pickle.PickleBuffer) -> bool:
        try:
            view = buffer.raw()
        except BufferError:  # not contiguous: it stays in the pickle
            return True
        if view.nbytes < _MIN_OUT_OF_BAND:
            return True  # in band
        buffers.append(buffer)
        return False

    return keep


def _pickled(value: Any) -> tuple[memoryview, list[pickle.PickleBuffer]]:
    """``value``'s pickle and its large buffers, which the pickle does not hold."""
    buffers: list[pickle.PickleBuffer] = []
    head = io.BytesIO()
    _pickler_class()(head, protocol=5, buffer_callback=out_of_band(buffers)).dump(value)
    return head.getbuffer(), buffers


def pack(value: Any) -> Framed:
    """``value`` pickled once, its large buffers not copied: to send on a channel.

    The result's ``buffers`` are ``pickle.PickleBuffer`` objects over the value's
    own memory; pickling the result with protocol 5 and a ``buffer_callback``
    (the pool channel's frames) sends them out of band, as they are.
    """
    head, buffers = _pickled(value)
    return Framed(bytes(head), list(buffers))


def dump(value: Any, path: str) -> None:
    """Pickle ``value`` once into ``path``, large buffers out of band (created 0600).

    Raises:
        OSError: the file could not be written (a full disk); nothing is left at ``path``.
            Pickling errors propagate as they are.
    """
    write(pack(value), path)


def framed_size(framed: Framed) -> int:
    """Bytes :func:`write` puts on disk for ``framed``."""
    parts = [memoryview(framed.data), *(_raw(b) for b in framed.buffers)]
    offset = len(_MAGIC) + _LEN.size * (1 + len(parts))
    for part in parts:
        offset += _padding(offset) + part.nbytes
    return offset


def write(framed: Framed, path: str) -> None:
    """Write ``framed`` to ``path`` (created 0600) in the layout :func:`load` reads.

    The whole size is reserved before anything is written, so a full disk fails
    at once rather than after most of the bytes; on any error the partial file
    is removed, so the disk gets its space back and no half-written result exists.

    Raises:
        OSError: the file could not be written; nothing is left at ``path``.
    """
    parts = [memoryview(framed.data), *(_raw(b) for b in framed.buffers)]
    total = framed_size(framed)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                os.posix_fallocate(out.fileno(), 0, total)
            except OSError as exc:
                # Filesystems without fallocate still get the write below; a full one does not.
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            header = _MAGIC + _LEN.pack(len(parts)) + b"".join(_LEN.pack(p.nbytes) for p in parts)
            out.write(header)
            offset = len(header)
            for part in parts:
                pad = _padding(offset)
                out.write(b"\0" * pad)
                out.write(part)
                offset += pad + part.nbytes
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def _raw(buffer: Any) -> memoryview:
    return buffer.raw() if isinstance(buffer, pickle.PickleBuffer) else memoryview(buffer)


def load(path: str) -> Framed:
    """Read what :func:`dump` wrote; the value is not unpickled yet.

    A large file is mapped copy-on-write rather than read: the value's tensors
    then use the pages the rank wrote, without a copy (the mapping outlives the
    file, which the launcher removes after the call).
    """
    with open(path, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        if size >= _MAP_AT_LEAST:
            view = memoryview(mmap.mmap(src.fileno(), size, access=mmap.ACCESS_COPY))
            got = size
        else:
            view = memoryview(bytearray(size))
            got = 0
            while got < size:
                n = src.readinto(view[got:])
                if not n:
                    break
                got += n
    if got != size or bytes(view[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a complete result file ({got} of {size} bytes)")
    (count,) = _LEN.unpack_from(view, 4)
    offset = 4 + _LEN.size
    lengths = [_LEN.unpack_from(view, offset + i * _LEN.size)[0] for i in range(count)]
    offset += count * _LEN.size
    parts = []
    for length in lengths:
        offset += _padding(offset)
        parts.append(view[offset : offset + length])
        offset += length
    if offset != size or not parts:
        raise ValueError(f"{path} is not a complete result file (parts do not add up)")
    return Framed(parts[0], parts[1:])
