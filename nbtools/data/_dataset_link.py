"""What a loader may ask of a dataset it drives: the one declared interface between them.

``DataLoader`` plans each iteration of every ``VolumeDataset`` it reads, hands
the plan to the worker copies it is about to start, and reports what the
training loop received. It does all of that through :class:`Link`, and through
nothing else of the dataset besides the public ``state_dict`` /
``load_state_dict``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbtools.data._cache._file_cache import FileCache
    from nbtools.data._plan import Plan
    from nbtools.data.dataset import VolumeDataset

__all__ = ["Link"]


class Link:
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

    def plan(self, num_workers: int, reuse: Plan | None, hold: int | None) -> Plan:
        """Decide what the next iteration serves (a collective on every rank).

        Returns ``reuse`` itself when it would serve exactly the same work.
        """
        return self.dataset._prepare(num_workers, tracked=True, reuse=reuse, hold=hold)

    def give_workers(self, plan: Plan | None) -> None:
        """The plan the worker copies made next (started or forked) serve; None after."""
        self.dataset._pending = plan

    def received(self, plan_id: str, slot: int, count: int) -> None:
        """The training loop received ``count`` paths of ``slot`` under ``plan_id``."""
        self.dataset._record(plan_id, slot, count)

    def received_batch(self) -> None:
        """The training loop received one more batch."""
        self.dataset._record_batch()

    def finished(self) -> None:
        """The loader reached the end of its iteration on this rank."""
        self.dataset._finish_local()

    def cache(self) -> FileCache:
        """The dataset's cache."""
        return self.dataset._open_cache()

    def stream_share(self, num_workers: int) -> tuple[int, int]:
        """``(bytes, largest file)``: what one stream may hold of the node's cache."""
        return self.dataset._stream_share(num_workers)
