"""DCP shard files: writing items with checksums, verifying them, reading them back.

A shard file is the concatenation of its items, exactly as PyTorch's
``FileSystemWriter`` lays it out (raw bytes for byte items, one ``torch.save``
record per tensor), so ``FileSystemReader`` reads it. Each item's
``_StorageInfo`` additionally carries ``checksum`` (CRC-32 of the item's bytes
in the file) and ``writer`` (a random token of the ``write_data`` call that
wrote the file): extra attributes that plain unpickling restores and PyTorch's
reader ignores. After its items, each file ends with a short trailer holding
that token; readers only read the item ranges the metadata names, so the
trailer is invisible to them. When an item's bytes do not match its checksum,
the trailer tells whether the file is still the one the metadata describes
(then it was damaged) or was written again by another save (two writers, or
colliding file prefixes, in one directory).
"""

from __future__ import annotations

import io
import os
import uuid
import zlib
from collections.abc import Iterable, Sequence
from typing import IO, Any, cast, overload

import torch
from torch.distributed.checkpoint.planner import SavePlanner

from nbtools import _torch_compat
from nbtools.errors import CorruptCheckpointError

__all__ = [
    "write_shard",
    "verify_items",
    "read_item_into",
    "item_checksum",
    "item_writer",
    "new_writer_token",
    "file_writer",
    "CHECKSUM_ATTR",
    "WRITER_ATTR",
]

CHECKSUM_ATTR = "checksum"
WRITER_ATTR = "writer"
_TRAILER_MAGIC = b"\nnbtools-shard-writer:"
_TOKEN_LEN = 32
_TRAILER_LEN = len(_TRAILER_MAGIC) + _TOKEN_LEN + 1
_CHUNK = 4 << 20
#: Bytes written between two requests to start writeback, for files that will be fsynced.
_WRITEBACK_EVERY = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``[offset, offset + nbytes)`` of ``fd`` to disk without waiting for it.

    The disk then works while the rest of the file is produced, and the final
    fsync has little left to do. Linux ``sync_file_range``; a no-op elsewhere. It is
    only a hint: whatever it does not write, the fsync that follows does.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            func = ctypes.CDLL(None, use_errno=True).sync_file_range
            func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = func
        except (AttributeError, OSError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _HashingWriter(io.RawIOBase):
    """Writes through to ``raw`` and keeps the CRC-32 of what was written since ``begin``.

    With ``writeback_every``, writeback to disk is started after each such many bytes.
    """

    def __init__(self, raw: IO[bytes], writeback_every: int = 0) -> None:
        super().__init__()
        self._raw = raw
        self._pos = 0
        self._written_back = 0
        self._writeback_every = writeback_every
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self._raw.write(view)
        self._pos += view.nbytes
        if self._writeback_every and self._pos - self._written_back >= self._writeback_every:
            self._raw.flush()
            _start_writeback(self._raw.fileno(), self._written_back, self._pos - self._written_back)
            self._written_back = self._pos
        return view.nbytes

    def tell(self) -> int:
        return self._pos

    def begin(self) -> int:
        self.crc = 0
        return self._pos

    def close(self) -> None:  # torch.save closes its stream; the file stays open
        pass


def _tensor_for_write(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # save only the elements, not a larger shared storage
    return tensor


def new_writer_token() -> str:
    """A fresh random token identifying one ``write_data`` call's files."""
    return uuid.uuid4().hex


def write_shard(
    file: IO[bytes],
    relative_path: str,
    items: Sequence[Any],
    planner: SavePlanner,
    writeback: bool = False,
    token: str | None = None,
) -> list[Any]:
    """Write DCP ``WriteItem``s to ``file``; return their ``WriteResult``s with checksums.

    Args:
        file: The open shard file, positioned at its start.
        relative_path: The file's name in the checkpoint directory.
        items: The items to write.
        planner: DCP's save planner (resolves each item's data).
        writeback: ``file`` will be fsynced where it is; start writing it to disk early.
        token: The writer token recorded on each item and in the file's trailer.
    """
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    storage_info = _torch_compat.storage_info_class()
    stream = _HashingWriter(file, _WRITEBACK_EVERY if writeback else 0)
    results = []
    # Byte items first, then tensors, like FileSystemWriter.
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    for item in ordered:
        # SavePlanner's contract: a BYTE_IO item resolves to a BytesIO, any other to a Tensor.
        data = planner.resolve_data(item)
        offset = stream.begin()
        if item.type == WriteItemType.BYTE_IO:
            stream.write(cast(io.BytesIO, data).getbuffer())
        else:
            # torch.save writes to any binary file; typeshed's IO is a nominal class that
            # io.RawIOBase does not derive from.
            torch.save(_tensor_for_write(cast(torch.Tensor, data)), cast(IO[bytes], stream))
        length = stream.tell() - offset
        info = storage_info(relative_path, offset, length)
        setattr(info, CHECKSUM_ATTR, f"crc32:{stream.crc:08x}")
        if token is not None:
            setattr(info, WRITER_ATTR, token)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    if token is not None:
        stream.write(_TRAILER_MAGIC + token.encode("ascii") + b"\n")
    file.flush()
    return results


def item_checksum(info: Any) -> str | None:
    """The checksum recorded for a ``_StorageInfo`` (None for checkpoints written by others)."""
    return getattr(info, CHECKSUM_ATTR, None)


def item_writer(info: Any) -> str | None:
    """The writer token recorded for a ``_StorageInfo`` (None when none was recorded)."""
    return getattr(info, WRITER_ATTR, None)


def file_writer(file: IO[bytes]) -> str | None:
    """The writer token in the trailer of an open shard file (None when it has none)."""
    try:
        end = file.seek(0, os.SEEK_END)
        if end is None:
            end = file.tell()
        if end < _TRAILER_LEN:
            return None
        file.seek(end - _TRAILER_LEN)
        tail = file.read(_TRAILER_LEN)
    except (OSError, ValueError):
        return None
    if len(tail) != _TRAILER_LEN or not tail.startswith(_TRAILER_MAGIC) or tail[-1:] != b"\n":
        return None
    return tail[len(_TRAILER_MAGIC) : -1].decode("ascii", "replace")


def _rewritten(where: str, info: Any, file: IO[bytes] | None) -> CorruptCheckpointError | None:
    """The error for a file that another save wrote after this item's, if ``file`` shows that.

    None when the file still carries the token recorded for the item, or when no
    token was recorded (a checkpoint written by another tool): then nothing tells
    a rewrite from damage.
    """
    expected = item_writer(info)
    if expected is None or file is None:
        return None
    found = file_writer(file)
    if found == expected:
        return None
    by = "a writer that leaves no nbtools trailer" if found is None else "another nbtools save"
    return CorruptCheckpointError(
        f"{where}: {info.relative_path} is not the file this checkpoint's metadata describes: "
        f"it was written again by {by} after this save wrote it. Two saves wrote into one "
        "directory at the same time, or their file prefixes collided (for example "
        "use_collectives=False or no_dist=True on several processes that share a rank "
        "number). The data is not damaged on disk but this checkpoint is not usable: give "
        "every save its own directory and restore from another checkpoint"
    )


def _truncated(where: str, info: Any, file: IO[bytes] | None = None) -> CorruptCheckpointError:
    return _rewritten(where, info, file) or CorruptCheckpointError(
        f"{where}: {info.relative_path} ends before byte {info.offset + info.length} "
        "(file truncated)"
    )


def _mismatch(where: str, info: Any, file: IO[bytes] | None = None) -> CorruptCheckpointError:
    return _rewritten(where, info, file) or CorruptCheckpointError(
        f"{where}: bytes {info.offset}..{info.offset + info.length} of "
        f"{info.relative_path} do not match their checksum (damaged in transfer or on "
        "disk); restore from another checkpoint"
    )


@overload
def _read_crc(file: IO[bytes], view: memoryview, crc: int, info: Any, where: str) -> int: ...
@overload
def _read_crc(file: IO[bytes], view: memoryview, crc: None, info: Any, where: str) -> None: ...
@overload
def _read_crc(
    file: IO[bytes], view: memoryview, crc: int | None, info: Any, where: str
) -> int | None: ...
def _read_crc(
    file: IO[bytes], view: memoryview, crc: int | None, info: Any, where: str
) -> int | None:
    """Fill ``view`` from ``file`` chunk by chunk, extending ``crc`` (unless None) as it goes.

    Each chunk's checksum runs right after the chunk is read, while it is still in cache.
    """
    done = 0
    while done < len(view):
        # typing.IO declares no readinto; every binary file io and fsspec open has it.
        n = file.readinto(view[done : done + _CHUNK])  # type: ignore[attr-defined]
        if not n:
            raise _truncated(where, info, file)
        if crc is not None:
            crc = zlib.crc32(view[done : done + n], crc)
        done += n
    return crc


def verify_items(file: IO[bytes], infos: Iterable[Any], where: str) -> None:
    """Re-read each item's bytes from ``file`` and compare them with its recorded checksum.

    Raises:
        CorruptCheckpointError: An item is short or its CRC-32 differs.
    """
    view = memoryview(bytearray(_CHUNK))
    for info in sorted(infos, key=lambda i: i.offset):
        expected = item_checksum(info)
        if expected is None:
            continue
        file.seek(info.offset)
        remaining, crc = info.length, 0
        while remaining:
            n = min(remaining, _CHUNK)
            crc = _read_crc(file, view[:n], crc, info, where)
            remaining -= n
        if f"crc32:{crc:08x}" != expected:
            raise _mismatch(where, info, file)


def read_item_into(
    path: str, info: Any, data_offset: int, dest: memoryview, verify: bool, where: str
) -> None:
    """Read a tensor item's data bytes (at ``data_offset`` in ``path``) straight into ``dest``.

    With ``verify``, the item's framing before and after the data is read too, so
    its recorded checksum (when there is one) is checked over exactly the bytes
    it was taken of.

    Raises:
        CorruptCheckpointError: The item is short or its CRC-32 differs.
    """
    expected = item_checksum(info) if verify else None
    crc = None if expected is None else 0
    with open(path, "rb", buffering=0) as fh:
        if crc is not None:
            fh.seek(info.offset)
            crc = _read_crc(fh, memoryview(bytearray(data_offset - info.offset)), crc, info, where)
        fh.seek(data_offset)
        crc = _read_crc(fh, dest, crc, info, where)
        if crc is not None:
            tail = info.offset + info.length - data_offset - len(dest)
            crc = _read_crc(fh, memoryview(bytearray(tail)), crc, info, where)
        if expected is not None and f"crc32:{crc:08x}" != expected:
            raise _mismatch(where, info, fh)
