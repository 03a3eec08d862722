"""The demo's data: one small binary file per sample on a "volume" directory.

Each file holds one sample: its id (int64), ``FEATURES`` float32 inputs and one
float32 target from a fixed random teacher, so that the loss falls visibly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

__all__ = ["FEATURES", "make_volume", "decode", "DecodedSamples"]

#: Inputs per sample.
FEATURES = 16
_RECORD = np.dtype([("id", "<i8"), ("x", "<f4", (FEATURES,)), ("y", "<f4")])


def make_volume(root: str | os.PathLike[str], samples: int = 128, seed: int = 0) -> list[str]:
    """Write ``samples`` files ``sample_<id>.bin`` under ``root`` (kept when already there).

    Returns:
        The paths of the files, in id order.
    """
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal(FEATURES).astype(np.float32)
    paths = []
    for sample_id in range(samples):
        x = rng.standard_normal(FEATURES).astype(np.float32)
        y = np.tanh(x @ teacher / 2) + np.float32(0.05) * rng.standard_normal(dtype=np.float32)
        path = os.path.join(root, f"sample_{sample_id:05d}.bin")
        paths.append(path)
        if os.path.exists(path):
            continue
        record = np.array([(sample_id, x, y)], dtype=_RECORD)
        # Written under a temporary name and renamed: a reader never sees half a file.
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(record.tobytes())
        os.replace(tmp, path)
    return paths


def decode(raw: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sample file's bytes as ``(id, x, y)`` tensors."""
    if len(raw) != _RECORD.itemsize:
        raise ValueError(f"a sample file has {_RECORD.itemsize} bytes, this one {len(raw)}")
    record = np.frombuffer(raw, dtype=_RECORD)[0]
    return (
        torch.tensor(int(record["id"])),
        torch.from_numpy(record["x"].copy()),
        torch.tensor([float(record["y"])]),
    )


class DecodedSamples(IterableDataset):
    """Decodes each path a ``VolumeDataset`` yields, at once and in order.

    The ``VolumeDataset`` stays an attribute and its position is forwarded, so
    ``nbtools.data.DataLoader`` saves and restores the place in the epoch.
    """

    def __init__(self, files: Any) -> None:
        self.files = files

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for path in self.files:
            with open(path, "rb") as fh:  # now: a yielded path may be evicted later
                raw = fh.read()
            yield decode(raw)

    def state_dict(self) -> dict[str, Any]:
        return self.files.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.files.load_state_dict(state)
