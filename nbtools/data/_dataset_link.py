"""What a loader may ask of a dataset it drives: the one declared interface between them.

``DataLoader`` plans each iteration of every ``VolumeDataset`` it reads, hands
the plan to the worker copies it is about to start, and reports what the
training loop received. It does all of that through :class:`DatasetLink`, and through
nothing else of the dataset besides the public ``state_dict`` /
``load_state_dict``. :func:`find_volume_datasets` finds the datasets a
loader drives inside the one it was given.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbtools.data._cache import FileCache
    from nbtools.data._plan import IterationPlan
    from nbtools.data.dataset import VolumeDataset

__all__ = ["DatasetLink", "find_volume_datasets"]

_MAX_DEPTH = 4
_MAX_CHILDREN = 64  # a wrapper's large sample lists are not searched through


class DatasetLink:
    """A loader's handle on one ``VolumeDataset``.

    Args:
        dataset: The dataset driven.
    """

    __slots__ = ("dataset",)

    def __init__(self, dataset: VolumeDataset) -> None:
        self.dataset = dataset

    @property
    def stream_id(self) -> str:
        """The id under which the dataset's streams tag the batches they feed."""
        return self.dataset._uid

    def plan(
        self,
        num_workers: int,
        reuse: IterationPlan | None,
        hold: int | None,
        shares: tuple[int, ...] | None = None,
        drop_last: bool = False,
    ) -> IterationPlan:
        """Decide what the next iteration serves (a collective on every rank).

        ``shares``: each rank's part of a global batch, served whole step by
        step (``drop_last``: without the smaller last one). Returns ``reuse``
        itself when it would serve exactly the same work.
        """
        return self.dataset._prepare(
            num_workers, tracked=True, reuse=reuse, hold=hold, shares=shares, drop_last=drop_last
        )

    def give_workers(self, plan: IterationPlan | None) -> None:
        """The plan the worker copies made next (started or forked) serve; None after."""
        self.dataset._pending = plan

    def received(self, plan_id: str, slot: int, count: int) -> None:
        """The training loop received ``count`` paths of ``slot`` under ``plan_id``."""
        self.dataset._record(plan_id, slot, count)

    def received_batch(self) -> None:
        """The training loop received one more batch."""
        self.dataset._record_batch()

    def position(self) -> tuple[dict[int, int], int]:
        """What the training loop received so far under the current plan, to put back with
        :meth:`restore` when a batch marked received never reached the loop."""
        return dict(self.dataset._counts), self.dataset._batches

    def restore(self, position: tuple[dict[int, int], int]) -> None:
        """Put back a position taken with :meth:`position`."""
        counts, batches = position
        self.dataset._counts, self.dataset._batches = dict(counts), batches

    def finished(self) -> None:
        """The loader reached the end of its iteration on this rank."""
        self.dataset._finish_local()

    def cache(self) -> FileCache:
        """The dataset's cache."""
        return self.dataset._open_cache()

    def stream_share(self, num_workers: int) -> tuple[int, int]:
        """``(bytes, largest file)``: what one stream may hold of the node's cache."""
        return self.dataset._stream_share(num_workers)


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
