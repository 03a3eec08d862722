"""DCP shard files: writing items with checksums, verifying them, reading them back.

A shard file is the concatenation of its items, exactly as PyTorch's
``FileSystemWriter`` lays it out (raw bytes for byte items, one ``torch.save``
record per tensor), so ``FileSystemReader`` reads it. Each item's
``_StorageInfo`` additionally carries ``checksum`` (CRC-32 of the item's bytes
in the file): an extra attribute that plain unpickling restores and PyTorch's
reader ignores.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterable, Sequence
from typing import IO, Any

import torch

from nbtools.errors import CorruptCheckpointError

__all__ = ["write_shard", "verify_items", "item_checksum", "CHECKSUM_ATTR"]

CHECKSUM_ATTR = "checksum"
_CHUNK = 16 << 20


class _HashingWriter(io.RawIOBase):
    """Writes through to ``raw`` and keeps the CRC-32 of what was written since ``begin``."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self._pos = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self._raw.write(view)
        self._pos += view.nbytes
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


def write_shard(
    file: IO[bytes], relative_path: str, items: Sequence[Any], planner: Any
) -> list[Any]:
    """Write DCP ``WriteItem``s to ``file``; return their ``WriteResult``s with checksums."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    stream = _HashingWriter(file)
    results = []
    # Byte items first, then tensors, like FileSystemWriter.
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    for item in ordered:
        data = planner.resolve_data(item)
        offset = stream.begin()
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        else:
            torch.save(_tensor_for_write(data), stream)
        length = stream.tell() - offset
        info = _StorageInfo(relative_path, offset, length)
        setattr(info, CHECKSUM_ATTR, f"crc32:{stream.crc:08x}")
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    file.flush()
    return results


def item_checksum(info: Any) -> str | None:
    """The checksum recorded for a ``_StorageInfo`` (None for checkpoints written by others)."""
    return getattr(info, CHECKSUM_ATTR, None)


def verify_items(file: IO[bytes], infos: Iterable[Any], where: str) -> None:
    """Re-read each item's bytes from ``file`` and compare them with its recorded checksum.

    Raises:
        CorruptCheckpointError: An item is short or its CRC-32 differs.
    """
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for info in sorted(infos, key=lambda i: i.offset):
        expected = item_checksum(info)
        if expected is None:
            continue
        file.seek(info.offset)
        remaining, crc = info.length, 0
        while remaining:
            n = file.readinto(view[: min(remaining, _CHUNK)])
            if not n:
                raise CorruptCheckpointError(
                    f"{where}: {info.relative_path} ends before byte {info.offset + info.length} "
                    "(file truncated)"
                )
            crc = zlib.crc32(view[:n], crc)
            remaining -= n
        if f"crc32:{crc:08x}" != expected:
            raise CorruptCheckpointError(
                f"{where}: bytes {info.offset}..{info.offset + info.length} of "
                f"{info.relative_path} do not match their checksum (damaged in transfer or on "
                "disk); restore from another checkpoint"
            )
