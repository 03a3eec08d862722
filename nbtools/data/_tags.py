"""How a loader learns how far each dataset stream had got when a batch was made.

Each :class:`~nbtools.data.VolumeDataset` stream records, in the process that
runs it (a loader worker or the main process), how many paths it has handed
out under which plan. The loader's collate function runs in that same process
right after a batch is assembled, so it can attach a snapshot of those counts
to the batch. The loader unwraps the batch in the training process: only then
does the batch count as received, so batches prefetched by workers but never
received do not count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

__all__ = ["note", "snapshot", "Tagged", "TaggingCollate"]

#: dataset uid -> (plan id, slot, paths handed out), per process.
_LIVE: dict[str, tuple[str, int, int]] = {}


def note(uid: str, plan_id: str, slot: int, count: int) -> None:
    """Record that stream ``uid`` handed out ``count`` paths of ``slot`` under ``plan_id``."""
    _LIVE[uid] = (plan_id, slot, count)


def snapshot() -> dict[str, tuple[str, int, int]]:
    """The current counts of every stream in this process."""
    return dict(_LIVE)


class Tagged:
    """A batch together with the stream counts at the moment it was made."""

    __slots__ = ("batch", "tags")

    def __init__(self, batch: Any, tags: dict[str, tuple[str, int, int]]) -> None:
        self.batch = batch
        self.tags = tags

    def pin_memory(self, device: Any = None) -> Tagged:
        """Pin the batch (called by the loader's pin-memory thread)."""
        return Tagged(_pin_memory(self.batch, device), self.tags)


class TaggingCollate:
    """Wraps a collate function so that its result carries :func:`snapshot`."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Tagged:
        return Tagged(self.collate_fn(data), snapshot())
