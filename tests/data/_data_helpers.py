"""File trees for the data tests (imported by the tests and their conftest)."""

from __future__ import annotations

import hashlib
import os

from torch.utils.data import IterableDataset

__all__ = ["Indices", "content", "make_tree", "index_of"]


def content(i: int, size: int) -> bytes:
    """Deterministic, distinct content of file ``i``."""
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def make_tree(root, n: int, size: int = 64, dirs: int = 3) -> list[str]:
    """``n`` files ``d<k>/f<i>.bin`` under ``root``; returns their relative paths."""
    rels = []
    for i in range(n):
        rel = f"d{i % dirs}/f{i:05d}.bin"
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(content(i, size))
        rels.append(rel)
    return rels


def index_of(path: str) -> int:
    """The ``i`` of a cached ``f<i>.bin`` path."""
    return int(os.path.basename(path)[1:6])


class Indices(IterableDataset):
    """The usual decoding wrapper, reduced to yielding the ``i`` of each cached path."""

    def __init__(self, files) -> None:
        self.files = files

    def __iter__(self):
        for path in self.files:
            yield index_of(path)
