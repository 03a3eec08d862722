"""``serverless_gpu.data``: the documented data and checkpoint names, as nbtools' classes.

- ``UCVolumeDataset(path)``: :class:`nbtools.data.VolumeDataset` (cached local
  copies of a volume's files; ``SGC_FSLAYER_MIN_FREE_DISK_BYTES`` sets the free
  space kept, like ``NBTOOLS_CACHE_MIN_FREE_BYTES``).
- ``DataLoader``: :class:`nbtools.data.DataLoader` (persistent workers, resumable).
- ``UCVolumeWriter(path)`` / ``UCVolumeReader(path)``: the DCP storage backends
  :class:`nbtools.checkpoint.VolumeWriter` / :class:`nbtools.checkpoint.VolumeReader`.
  A save into a directory that holds a complete checkpoint replaces it atomically.

Example:
    >>> from nbtools.compat.serverless_gpu.data import UCVolumeWriter
    >>> dcp.save(state_dict, storage_writer=UCVolumeWriter("/mnt/vol/ckpt/step_8"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

from nbtools.checkpoint import VolumeReader as UCVolumeReader
from nbtools.checkpoint import VolumeWriter as UCVolumeWriter
from nbtools.data import DataLoader, VolumeDataset

__all__ = ["UCVolumeDataset", "DataLoader", "UCVolumeWriter", "UCVolumeReader"]

_MIN_FREE_ENV = "SGC_FSLAYER_MIN_FREE_DISK_BYTES"


class UCVolumeDataset(VolumeDataset):
    """The documented ``UCVolumeDataset(path)``: nbtools' ``VolumeDataset`` under that name.

    Args:
        path: The volume directory (a mounted path, or an fsspec URL).
        *args: Further arguments of :class:`nbtools.data.VolumeDataset`.
        **kwargs: Further keyword arguments of :class:`nbtools.data.VolumeDataset`.
    """

    def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        raw = os.environ.get(_MIN_FREE_ENV)
        if raw and "min_free_bytes" not in kwargs:
            try:
                kwargs["min_free_bytes"] = int(raw)
            except ValueError:
                raise ValueError(
                    f"{_MIN_FREE_ENV} must be a number of bytes, got {raw!r}"
                ) from None
        super().__init__(path, *args, **kwargs)
