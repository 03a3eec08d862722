"""Tensor records copied into their destinations as they are, without a second read.

A DCP tensor record is one ``torch.save`` archive; the tensor's memory lies in
it as one run of bytes. :func:`saved_data` finds that run (reading the
archive's small framing only). Where a rank loads a whole saved tensor into a
dense CPU tensor of the same dtype and shape, those bytes are the
destination's memory: a local load reads them straight into it, and a
hand-off (:func:`~nbtools.checkpoint._storage._coop_read.exchange`) copies them there
from the message, with :class:`Delivery`, instead of staging them.
"""

from __future__ import annotations

import io
import math
import os
import sys
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from nbtools import _torch_compat
from nbtools.checkpoint._storage._coop_read import Key
from nbtools.checkpoint._storage._transforms import descriptors_of

__all__ = ["Slice", "saved_data", "dense_destination", "Delivery"]


class Slice(io.RawIOBase):
    """A seekable read-only window ``[offset, offset + length)`` of an open file."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._len, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), self._len - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n])
        self._pos += got
        return got


def _window(fh: Any, offset: int, length: int) -> IO[bytes]:
    """A :class:`Slice` typed as the binary file it is (typeshed's ``IO`` is a nominal
    class that ``io.RawIOBase`` does not derive from; torch reads any such file)."""
    return cast(IO[bytes], Slice(fh, offset, length))


def saved_data(fh: Any, offset: int, length: int) -> tuple[torch.Tensor, int] | None:
    """The saved tensor (on the meta device) of the record ``[offset, offset + length)`` of
    ``fh`` and the offset of its data inside the record, when its memory is stored as
    one dense run of bytes in this machine's byte order; else None."""
    try:
        saved = torch.load(_window(fh, offset, length), map_location="meta", weights_only=True)
        at = _torch_compat.storage_data_offset(saved, _window(fh, offset, length))
        order = _torch_compat.saved_byteorder(_window(fh, offset, length))
    except Exception:  # noqa: BLE001 - the full load reports what is wrong
        return None
    if (
        (order is not None and order != sys.byteorder)
        or not isinstance(at, int)
        or not isinstance(saved, torch.Tensor)
        or not saved.is_contiguous()
        or saved.storage_offset() != 0
        or saved.untyped_storage().nbytes() != saved.numel() * saved.element_size()
        or saved.numel() == 0
    ):
        return None
    return saved, at


def dense_destination(target: torch.Tensor, dtype: torch.dtype, shape: Any) -> bool:
    """Whether ``target`` is a plain dense CPU tensor of ``dtype`` and ``shape``."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.dtype == dtype
        and tuple(target.size()) == tuple(shape)
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


class Delivery:
    """Where the records handed to one rank go (see :class:`~nbtools.checkpoint._storage._coop_read.Receiver`).

    Args:
        plan: This rank's load plan.
        storage_data: The checkpoint's ``MetadataIndex`` -> ``_StorageInfo``.
        tensors: The checkpoint's ``state_dict_metadata``.
        planner: The load's planner (its calls stay on the loading thread).
        staged: The local staging file of a relative path.
    """

    def __init__(
        self,
        plan: LoadPlan,
        storage_data: Any,
        tensors: dict[str, STORAGE_TYPES],
        planner: LoadPlanner,
        staged: Any,
    ) -> None:
        self._storage, self._tensors, self._planner = storage_data, tensors, planner
        self._staged = staged
        self._items: dict[Key, list[Any]] = {}
        for item in plan.items:
            info = storage_data[item.storage_index]
            key = (info.relative_path, int(info.offset), int(info.length))
            self._items.setdefault(key, []).append(item)
        self._open: dict[Key, tuple[Any, torch.Tensor]] = {}
        #: The plan's items loaded by delivery (by id).
        self.delivered: set[int] = set()

    def frame(self, key: Key) -> tuple[int, int]:
        name, offset, length = key
        with open(os.path.join(self._staged(name)), "rb") as fh:
            found = saved_data(fh, offset, length)
        if found is None:
            return -1, 0
        saved, at = found
        return at, saved.numel() * saved.element_size()

    def sink(self, key: Key, offset: int, nbytes: int) -> torch.Tensor | None:
        items = self._items.get(key, [])
        if len(items) != 1 or items[0].type != LoadItemType.TENSOR:
            return None
        item = items[0]
        if descriptors_of(self._storage[item.storage_index]) or any(item.storage_offsets):
            return None
        meta = self._tensors.get(item.storage_index.fqn)
        if not isinstance(meta, TensorStorageMetadata):
            return None  # a bytes record (or none): no chunk to match
        chunk = next(
            (c for c in meta.chunks if tuple(c.offsets) == tuple(item.storage_index.offset or ())),
            None,
        )
        if chunk is None or tuple(item.lengths) != tuple(chunk.sizes):
            return None
        dtype = meta.properties.dtype
        if nbytes != math.prod(chunk.sizes) * torch.empty((), dtype=dtype).element_size():
            return None
        target = self._planner.resolve_tensor(item).detach()
        if not dense_destination(target, dtype, chunk.sizes):
            return None
        self._open[key] = (item, target)
        return target.reshape(-1).view(torch.uint8)

    def done(self, key: Key) -> None:
        item, target = self._open.pop(key)
        self._planner.commit_tensor(item, target)
        self.delivered.add(id(item))

    def stages(self, key: Key, reader: int) -> bool:
        """A rank staging on its own writes every record it does not sink."""
        return True
