"""The plan of one iteration: which epoch, what was already consumed, and the slot layout."""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from nbtools.data._positions import (
    BatchLayout,
    Consumed,
    advance,
    batch_advance,
    batch_chunks,
    slot_chunks,
    slot_length,
)
from nbtools.errors import DataError

__all__ = [
    "IterationPlan",
    "check_same_batches",
    "check_same_workers",
    "data_group",
    "dist_info",
    "gather",
]


_GROUP_LOCK = threading.Lock()
_groups: tuple[Any, Any] | None = None  # (the default group it belongs to, the data group)


def data_group(dist: Any) -> Any:
    """The data layer's own gloo group over every rank of the (initialised) default group.

    Planning an iteration (``iter(loader)``) and ``state_dict()`` agree across
    ranks with object collectives. On the default group they would interleave
    with collectives other threads issue on that group at the same moment,
    above all ``dcp.async_save``, whose whole save (plan, write, metadata) runs
    in a background thread on the default group. Gloo matches collectives by
    their order on a group, so a rank whose main thread gathered the data plan
    while its save thread broadcast the save plan, and a rank that did both in
    the other order, would wait for each other forever.

    So one gloo group is created over all ranks, once per default group
    (``dist.new_group`` synchronizes through the store, not through a
    collective, so creating it while a save is in flight is safe). Every rank
    reaches its first data collective at the same point of its program, so
    every rank creates the group in the same order. ``dist.destroy_process_group()``
    destroys it with the default group; a later ``init_process_group`` gets a new one.
    """
    global _groups
    default = dist.group.WORLD
    with _GROUP_LOCK:
        if _groups is None or _groups[0] is not default:
            _groups = (default, dist.new_group(backend="gloo"))
        return _groups[1]


@dataclass(frozen=True)
class IterationPlan:
    """What one iteration of a dataset serves.

    Rank ``rank`` owns slots ``rank * num_workers + worker_id`` of a global
    stride of ``world_size * num_workers`` over the positions not in ``base``.
    ``tracked`` means a loader counts what the training loop received (from
    batch tags); otherwise the stream counts the paths it yields itself.
    ``hold`` is how many batches before the one being filled the loader may
    still hold (None outside an nbtools loader). ``check``: its streams look
    at each source before serving a cached copy; ``recheck``: every epoch
    does (``check_sources="epoch"``), not only until an epoch was served
    whole under a check (``"launch"``). ``shares``: each rank's part of a
    global batch (a loader's ``global_batch_size``): the slots serve whole
    global batches (:class:`~nbtools.data._positions.BatchLayout`) instead of
    a plain stride; ``drop_last`` skips the smaller last one.
    """

    plan_id: str
    epoch: int
    base: Consumed
    rank: int
    world_size: int
    num_workers: int
    tracked: bool
    rotation: int = 0
    hold: int | None = None
    check: bool = True
    recheck: bool = False
    shares: tuple[int, ...] | None = None
    drop_last: bool = False

    @property
    def layout(self) -> BatchLayout | None:
        """The global-batch layout of the slots, or None for the plain stride."""
        if self.shares is None:
            return None
        return BatchLayout(self.shares, self.num_workers, self.drop_last)

    def chunks(self, num_files: int, slot: int) -> Iterator[np.ndarray]:
        """The positions slot ``slot`` serves, in order, in arrays that grow to thousands."""
        layout = self.layout
        if layout is None:
            return slot_chunks(self.base, num_files, self.stride, slot, first=16, most=4096)
        return batch_chunks(self.base, num_files, layout, slot)

    def slot_length(self, num_files: int, slot: int) -> int:
        """How many positions slot ``slot`` serves."""
        layout = self.layout
        if layout is None:
            return slot_length(self.base, num_files, self.stride, slot)
        return layout.slot_length(num_files - self.base.count(), slot)

    def consumed_after(self, num_files: int, counts: dict[int, int]) -> Consumed:
        """``base`` plus the first ``counts[slot]`` positions of each slot."""
        layout = self.layout
        if layout is None:
            return advance(self.base, num_files, self.stride, counts)
        return batch_advance(self.base, num_files, layout, counts)

    @property
    def stride(self) -> int:
        """Number of slots over all ranks and workers."""
        return self.world_size * self.num_workers

    def slots(self) -> range:
        """The slots of this rank."""
        return range(self.rank * self.num_workers, (self.rank + 1) * self.num_workers)

    def slot_of(self, worker_id: int) -> int:
        """The slot loader worker ``worker_id`` of this rank serves.

        A loader takes batches from its workers in turn, starting with worker 0;
        ``rotation`` hands worker 0 the slot whose turn it was when the previous
        iteration stopped, so a resumed run with the same layout keeps the order.
        """
        return self.rank * self.num_workers + (worker_id + self.rotation) % self.num_workers

    def advanced(self) -> IterationPlan:
        """The plan a persistent worker assumes next: the following epoch, from its start.

        Its id derives from this one, so the training process can predict it.
        The next epoch checks its sources when every epoch does, or when this
        one did but started part-way (it did not look at every source).
        """
        return replace(
            self,
            plan_id=self.plan_id + "+",
            epoch=self.epoch + 1,
            base=Consumed(),
            rotation=0,
            check=self.next_checks(),
        )

    def next_checks(self) -> bool:
        """Whether the epoch after this one, once this one is served whole, checks sources."""
        return self.recheck or (self.check and self.base.count() > 0)

    def same_work(self, other: IterationPlan | None) -> bool:
        """True when ``other`` serves exactly the same files in the same places."""
        return other is not None and replace(other, plan_id=self.plan_id) == self

    @staticmethod
    def new_id() -> str:
        """A fresh plan id."""
        return secrets.token_hex(6)


def _dist() -> Any:
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default group, else ``(0, 1)``."""
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank (a collective when a group of several ranks is up).

    It runs on the data layer's own group (:func:`data_group`), so that
    a ``dcp.async_save`` in flight on the default group cannot cross it.
    """
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=data_group(dist))  # never on the default group
    return out


def check_same_workers(per_rank: list[int]) -> None:
    """Raise when ranks disagree on the number of loader workers."""
    if len(set(per_rank)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
        raise DataError(
            "ranks iterate the dataset with different numbers of loader workers "
            f"({listing}); the global stride over ranks x workers would duplicate or skip "
            "files. Pass the same num_workers on every rank."
        )


def check_same_batches(per_rank: list[int | None]) -> None:
    """Raise when ranks disagree on the loader's global batch size (None: none given)."""
    if len(set(per_rank)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
        raise DataError(
            f"ranks iterate the dataset with different global batch sizes ({listing}); "
            "every rank must take its share of the same global batch. Pass the same "
            "global_batch_size= to DataLoader on every rank."
        )
