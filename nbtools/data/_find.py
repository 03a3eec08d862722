"""Finding the ``VolumeDataset`` objects inside a (wrapped) dataset."""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["find_volume_datasets"]

_MAX_DEPTH = 4
_MAX_CHILDREN = 64  # a wrapper's large sample lists are not searched through


def find_volume_datasets(dataset: Any) -> list[Any]:
    """``VolumeDataset`` instances reachable from ``dataset`` through attributes,
    lists, tuples and dict values (four levels deep, the first 64 items of a
    container), in a stable order."""
    from nbtools.data.dataset import VolumeDataset

    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(obj))
        if isinstance(obj, VolumeDataset):
            found.append(obj)
            return
        if isinstance(obj, (list, tuple)):
            children = list(obj[:_MAX_CHILDREN])
        elif isinstance(obj, dict):
            children = list(itertools.islice(obj.values(), _MAX_CHILDREN))
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = list(vars(obj).values())
        else:
            return
        for child in children:
            if isinstance(child, (str, bytes, int, float, bool)) or child is None:
                continue
            visit(child, depth + 1)

    visit(dataset, 0)
    return found
