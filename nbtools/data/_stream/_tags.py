"""How a loader learns how far each dataset stream had got when a batch was made.

Each :class:`~nbtools.data.VolumeDataset` stream records, in the process that
runs it (a loader worker or the main process), how many paths it has handed
out under which plan. The loader's collate function runs in that same process
right after a batch is assembled, so it can attach a snapshot of those counts
to the batch. The loader unwraps the batch in the training process: only then
does the batch count as received, so batches prefetched by workers but never
received do not count.

The collate function also counts the batches made in its process and notes
whether they carry cached paths themselves (a loader over a bare
``VolumeDataset``, or a wrapper that yields paths): a stream then keeps the
files of the batches the loader may still hold pinned (see ``_stream``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbtools._torch_compat import pin_memory as _pin_memory

__all__ = [
    "Count",
    "track",
    "snapshot",
    "batches",
    "carries_paths",
    "watch_prefix",
    "Tagged",
    "TaggingCollate",
]


class Count:
    """How many paths one stream handed out of ``slot`` under ``plan_id``; the stream adds to ``n``."""

    __slots__ = ("plan_id", "slot", "n")

    def __init__(self, plan_id: str, slot: int) -> None:
        self.plan_id = plan_id
        self.slot = slot
        self.n = 0


#: dataset uid -> the count of its current stream, per process.
_LIVE: dict[str, Count] = {}
#: Batches collated in this process so far.
_BATCHES = 0
#: Whether batches carried cached paths: None until the first batch is made.
_CARRIES: bool | None = None
#: Cache directories (with a trailing separator) whose paths streams hand out.
_PREFIXES: tuple[str, ...] = ()


def batches() -> int:
    """Batches collated in this process so far (the index of the batch being filled)."""
    return _BATCHES


def carries_paths() -> bool | None:
    """Whether batches of this process carry cached paths (None: no batch made yet)."""
    return _CARRIES


def watch_prefix(prefix: str) -> None:
    """Look for paths under ``prefix`` in the batches this process makes."""
    global _PREFIXES
    if prefix not in _PREFIXES:
        _PREFIXES = (*_PREFIXES, prefix)


def _is_cached_path(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(_PREFIXES)


def _has_cached_path(sample: Any) -> bool:
    if _is_cached_path(sample):
        return True
    if isinstance(sample, (tuple, list)):
        return any(_is_cached_path(v) for v in sample)
    if isinstance(sample, dict):
        return any(_is_cached_path(v) for v in sample.values())
    return False


def _count_batch(data: Any) -> None:
    global _BATCHES, _CARRIES
    _BATCHES += 1
    if _CARRIES or not _PREFIXES:
        return
    samples = data if isinstance(data, (list, tuple)) else (data,)
    if _CARRIES is False and len(samples) > 2:
        samples = (samples[0], samples[-1])  # the samples of one loader share their shape
    carried = any(_has_cached_path(s) for s in samples)
    _CARRIES = carried or bool(_CARRIES)


def track(uid: str, plan_id: str, slot: int) -> Count:
    """Start counting the paths the stream of dataset ``uid`` hands out of ``slot``."""
    count = _LIVE[uid] = Count(plan_id, slot)
    return count


def snapshot() -> dict[str, tuple[str, int, int]]:
    """``uid -> (plan id, slot, paths handed out)`` of every stream in this process now."""
    return {uid: (c.plan_id, c.slot, c.n) for uid, c in _LIVE.items()}


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
        _count_batch(data)
        return Tagged(self.collate_fn(data), snapshot())
