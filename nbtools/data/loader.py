"""``DataLoader``: PyTorch's loader with persistent workers, a resumable position and wait times.

Input stalls: a :class:`StallWatch` keeps the loader's recent wait times (the first batch of
each iteration left out: it includes starting the workers). A wait is a stall when it is at
least ``MIN_STALL_S`` and ``FACTOR`` times the median of the recent waits; it is then emitted
as an ``input_stall`` event (with the emitting rank, the seconds waited and the usual wait),
which the GPU pane draws as a shaded span ending when the batch arrived. The common path, a
wait under ``MIN_STALL_S``, costs one comparison and one append.
"""

from __future__ import annotations

import errno
import os
import time
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from nbtools import _torch_compat, events, runtime
from nbtools.data._dataset_link import DatasetLink, find_volume_datasets
from nbtools.data._stream import Tagged, TaggingCollate
from nbtools.data.dataset import VolumeDataset
from nbtools.errors import CacheError, DataError

__all__ = ["DataLoader"]

_STATE_VERSION = 1

#: Shortest wait reported as a stall, in seconds.
MIN_STALL_S = 0.5
#: How many times the usual (median) wait a stall is at least.
FACTOR = 10.0
#: Recent waits the median is taken over.
WINDOW = 64
#: Waits seen before any is judged (the usual wait must be known first).
MIN_HISTORY = 3


class StallWatch:
    """Judges each wait of one loader; emits ``input_stall`` for the long ones."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=WINDOW)

    def observe(self, wait: float, first: bool = False) -> bool:
        """Record ``wait`` seconds; True (and an event) when it was a stall.

        Args:
            wait: Seconds the loop waited for the batch.
            first: The first batch of an iteration (recorded nowhere, never a stall).
        """
        if first:
            return False
        recent = self._recent
        stalled = False
        if wait >= MIN_STALL_S and len(recent) >= MIN_HISTORY:
            ordered = sorted(recent)
            usual = ordered[len(ordered) // 2]
            if wait >= FACTOR * usual:
                stalled = True
                events.emit(
                    "input_stall",
                    message=f"waited {wait:.2f} s for a batch (usually {usual:.3f} s)",
                    seconds=round(wait, 3),
                    usual_s=round(usual, 4),
                )
        recent.append(wait)
        return stalled


def _default_num_workers() -> int:
    """A few workers per rank on a node with CPUs to spare; none on a small machine.

    The copies run on threads inside each worker, so workers are needed for
    decoding, not for I/O.
    """
    per_rank = (os.cpu_count() or 1) // max(1, runtime.get_local_world_size())
    return 0 if per_rank <= 2 else min(4, per_rank - 1)


def _check_global_batch(batch_size: int | None, sampler: Any, batch_sampler: Any) -> None:
    """``global_batch_size=`` decides each rank's batch; refuse what would also decide it."""
    if batch_size != 1:
        raise ValueError(
            f"pass either batch_size={batch_size} (this rank's batch) or global_batch_size= "
            "(all ranks together; each rank's share comes from nbtools.runtime.batch_plan), "
            "not both"
        )
    if sampler is not None or batch_sampler is not None:
        raise ValueError(
            "global_batch_size= splits the VolumeDataset's files itself; it does not take a "
            "sampler= or batch_sampler="
        )


class DataLoader(torch.utils.data.DataLoader[Any]):
    """A drop-in ``torch.utils.data.DataLoader`` that resumes mid-epoch exactly.

    Differences from PyTorch's loader:

    * ``persistent_workers=True`` whenever ``num_workers > 0`` (workers and their
      cache state survive epochs); ``num_workers`` defaults to a few workers per
      rank when the node has CPUs to spare, ``prefetch_factor`` to 4.
    * :meth:`state_dict` / :meth:`load_state_dict` capture the position in the
      epoch of the :class:`VolumeDataset` it reads, counting only the batches the
      training loop received. The state does not depend on world size or
      ``num_workers``: restore it into a loader with any of either.
    * Each batch handed to the loop is reported as progress
      (``events.step(None)``, about a microsecond, never blocking), so the
      kernel sees a loop over this loader progress, and can flag it when it
      hangs or straggles, with no call in the loop.
    * ``global_batch_size=N`` (instead of ``batch_size``): every optimizer
      step takes exactly ``N`` samples over all ranks, each rank its share
      from :func:`nbtools.runtime.batch_plan` (shares differ by one when the
      world size does not divide ``N``; the attribute ``batch_plan`` holds them). The
      steps are consecutive blocks of ``N`` of the epoch's order, so a run
      resumed at another world size takes the same global batches, in the same
      order, each sample once. Scale the summed loss by :attr:`loss_scale`.
      The epoch's last step holds the samples left after the last whole
      global batch, split the same way (``drop_last=True`` skips them).
    * :attr:`wait_times` holds the seconds the loop waited for each batch of the
      current iteration (``last_wait`` the latest one).
    * Batches that carry cached paths (a bare ``VolumeDataset``) keep those
      files readable while the loader may still hold them; over a bare
      ``VolumeDataset`` on a cache too small for that, ``prefetch_factor`` is
      lowered with a ``ResourceWarning``.

    The dataset may be a ``VolumeDataset`` or a wrapper that keeps it as an
    attribute (for example a decoding ``IterableDataset`` that yields one sample
    per path, in order, as it receives them). A wrapper that forwards
    ``state_dict()``/``load_state_dict()`` to the ``VolumeDataset`` works too.
    A wrapper that reads paths ahead of what it yields (a shuffle buffer) makes
    those paths count as seen.

    Iterating again after an interrupted loop (``break``, Ctrl+C) continues the
    epoch where the loop stopped; a finished epoch is followed by the next one;
    ``set_epoch`` on the dataset chooses an epoch explicitly.

    Workers are started with PyTorch's default method (``fork`` on Linux). They
    only copy and decode files; doing CUDA work inside them after CUDA is
    initialised in the notebook fails, so keep GPU work in the training loop.
    Call :meth:`close` (or use ``with``) to stop persistent workers early.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | None = None,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        global_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        plan = None
        if global_batch_size is not None:
            _check_global_batch(batch_size, sampler, batch_sampler)
            plan = runtime.batch_plan(global_batch_size)
            batch_size = plan.local_batch_size
        # With a global batch the plan decides where the epoch ends: torch keeps every batch.
        drop_remainder, drop_last = drop_last, drop_last and plan is None
        if num_workers is None:
            num_workers = _default_num_workers()
        if num_workers > 0:
            if persistent_workers is False:
                warnings.warn(
                    "nbtools.data.DataLoader always keeps its workers between epochs "
                    "(persistent_workers=True), so that their cache state survives; "
                    "persistent_workers=False is ignored",
                    UserWarning,
                    stacklevel=2,
                )
            persistent_workers = True
            if prefetch_factor is None:
                prefetch_factor = 4
        else:
            persistent_workers = False
        if collate_fn is None:
            collate_fn = (
                torch.utils.data.default_collate
                if batch_size is not None or batch_sampler is not None
                else torch.utils.data.default_convert
            )
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            TaggingCollate(collate_fn),
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            **kwargs,
        )
        self.wait_times: list[float] = []
        self.last_wait: float = 0.0
        self._stalls = StallWatch()  # emits input_stall events for unusually long waits
        self._volumes: list[VolumeDataset] = find_volume_datasets(dataset)
        self.batch_plan: runtime.BatchPlan | None = plan
        # Whole global batches in the current iteration, and the size of its smaller last step.
        self._whole_steps, self._last_step = 0, 0
        self._drop_remainder = drop_remainder
        if plan is not None and not self._volumes:
            raise DataError(
                f"global_batch_size={global_batch_size} needs a VolumeDataset to split: the "
                f"loader's dataset ({type(dataset).__name__}) neither is one nor keeps one as an "
                "attribute. Wrap a VolumeDataset, or pass batch_size= (this rank's batch) instead"
            )
        self._links = [DatasetLink(vd) for vd in self._volumes]  # all the loader drives them by
        self._workers_expect: list[Any] | None = None  # plans the live workers will serve next

    # --- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.num_workers > 0 and _torch_compat.loader_iterator(self) is None:
            self._fit_prefetch()
        # Batches the loader may hold besides the one a worker fills: its
        # prefetched batches (per worker), none when the main process collates.
        hold = self.prefetch_factor if self.num_workers > 0 else 0
        shares = self.batch_plan.shares if self.batch_plan is not None else None
        plans = [
            link.plan(
                max(1, self.num_workers),
                reuse=self._workers_expect[i] if self._workers_expect else None,
                hold=hold,
                shares=shares,
                drop_last=self._drop_remainder,
            )
            for i, link in enumerate(self._links)
        ]
        workers_live = self.num_workers > 0 and _torch_compat.loader_iterator(self) is not None
        if (
            workers_live
            and self._workers_expect is not None
            and any(
                plan is not expected
                for plan, expected in zip(plans, self._workers_expect, strict=True)
            )
        ):
            # The live workers would start the next epoch from scratch, but this
            # iteration resumes mid-epoch or jumps: start workers with this plan.
            self._stop_workers()
            workers_live = False
        if not workers_live:
            for link, plan in zip(self._links, plans, strict=True):
                link.give_workers(plan)
        try:
            inner = super().__iter__()
        finally:
            if self.num_workers > 0:
                for link in self._links:
                    link.give_workers(None)  # the worker copies took it
        self._workers_expect = [p.advanced() for p in plans] if self.num_workers > 0 else None
        if self.batch_plan is not None:
            remaining = len(self._volumes[0]) - plans[0].base.count()
            self._whole_steps = remaining // self.batch_plan.global_batch_size
            self._last_step = (
                0 if self._drop_remainder else remaining % self.batch_plan.global_batch_size
            )
        self.wait_times = []
        return self._received(inner)

    def _fit_prefetch(self) -> None:
        """Lower ``prefetch_factor`` until the batches of paths it queues fit the cache.

        A loader over a bare ``VolumeDataset`` hands cached paths to the training
        loop; each worker keeps the files of every batch the loader may still
        hold, so ``(prefetch_factor + 1) * batch_size`` files plus one in flight
        must fit in the worker's share of the cache.
        """
        if not isinstance(self.dataset, VolumeDataset) or not self.prefetch_factor:
            return
        link = DatasetLink(self.dataset)
        share, largest = link.stream_share(self.num_workers)
        fits = share // max(1, largest)
        per_batch = self.batch_size or 1
        factor = (fits - 1) // per_batch - 1
        if factor >= self.prefetch_factor:
            return
        cache = link.cache()
        if factor < 1:
            exc = CacheError(
                f"the cache at {cache.dir!r} holds about {fits} files of up to {largest} bytes "
                f"per loader worker ({self.num_workers} workers; {cache.capacity} bytes usable, "
                f"{cache.min_free} kept free), but each worker must keep the paths of at least "
                f"two batches of {per_batch} readable while the loop uses them; use a larger "
                "cache filesystem, fewer workers or smaller batches, or open the files in a "
                "wrapper dataset inside the workers"
            )
            exc.errno = errno.ENOSPC
            raise exc
        text = (
            f"the cache at {cache.dir} holds about {fits} files per loader worker; this loader "
            f"keeps every path it queues readable, so it prefetches {factor} batches per worker "
            f"instead of prefetch_factor={self.prefetch_factor}"
        )
        warnings.warn(text, ResourceWarning, stacklevel=3)
        events.emit(
            "cache_full",
            message=text,
            prefetch_factor=factor,
            asked=self.prefetch_factor,
            files_per_worker=fits,
        )
        self.prefetch_factor = factor

    def _received(self, inner: Iterator[Any]) -> Iterator[Any]:
        by_id = {link.stream_id: link for link in self._links}
        while True:
            start = time.perf_counter()
            try:
                item = next(inner)
            except StopIteration:
                for link in self._links:
                    link.finished()
                return
            self.last_wait = time.perf_counter() - start
            events.step(None)  # a batch boundary: the kernel sees this rank progress
            self._stalls.observe(self.last_wait, first=not self.wait_times)
            batch = item.batch if isinstance(item, Tagged) else item
            # The batch counts as received in the same step as the loop gets it. A Ctrl-C
            # (or any exception) while it is being marked puts the marks back, so the batch
            # is served again; between the end of this block and the ``yield`` nothing lets
            # a signal handler run (no call, no backward jump), so a Ctrl-C lands either
            # before the marks are kept or after the loop holds the batch.
            waits = len(self.wait_times)
            before = [link.position() for link in self._links]
            try:
                self.wait_times.append(self.last_wait)
                if isinstance(item, Tagged):
                    for uid, (plan_id, slot, count) in item.tags.items():
                        target = by_id.get(uid)
                        if target is not None:
                            target.received(plan_id, slot, count)
                    for link in self._links:
                        link.received_batch()
            except BaseException:
                for link, position in zip(self._links, before, strict=True):
                    link.restore(position)
                del self.wait_times[waits:]
                raise
            yield batch

    @property
    def loss_scale(self) -> float:
        """What to multiply the *sum* of this rank's per-sample losses by, under DDP, for the
        batch received last.

        With ``global_batch_size=``: ``world_size / global_batch_size`` (see
        :attr:`nbtools.runtime.BatchPlan.loss_scale`), and ``world_size / R``
        on the epoch's smaller last step of ``R`` samples: DDP's average over
        the ranks then makes the gradient the mean over the step's global
        batch, whatever each rank's share. The same on every rank. Without
        ``global_batch_size``: ``1 / batch_size``, the usual mean over this
        rank's batch.

        Example:
            >>> for ids in loader:  # doctest: +SKIP
            ...     per_sample = loss_fn(ddp_model(inputs(ids)), targets(ids))  # reduction="none"
            ...     (per_sample.sum() * loader.loss_scale).backward()
        """
        plan = self.batch_plan
        if plan is None:
            return 1.0 / (self.batch_size or 1)
        if len(self.wait_times) > self._whole_steps and self._last_step:
            return plan.world_size / self._last_step
        return plan.loss_scale

    # --- state ----------------------------------------------------------------------

    @property
    def saves_position(self) -> bool:
        """Whether :meth:`state_dict` can save this loader's position: its dataset is or holds a
        ``VolumeDataset``, or has a ``state_dict`` of its own."""
        return bool(self._volumes) or callable(getattr(self.dataset, "state_dict", None))

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: plain Python, the same on every rank.

        A collective when a process group of several ranks is initialised:
        call it on every rank (a checkpoint manager does).

        Raises:
            DataError: the dataset has no position to save (no ``VolumeDataset``
                inside it and no ``state_dict`` of its own).
        """
        if self._volumes:
            return {
                "version": _STATE_VERSION,
                "datasets": [vd.state_dict() for vd in self._volumes],
            }
        save = getattr(self.dataset, "state_dict", None)
        if callable(save):
            return {"version": _STATE_VERSION, "dataset": save()}
        raise DataError(
            f"the loader's dataset ({type(self.dataset).__name__}) has no position to save: "
            "keep the VolumeDataset as an attribute of your wrapper dataset, or give the "
            "wrapper state_dict()/load_state_dict() methods that forward to it"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict`, with any world size or workers."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                "not a DataLoader state: pass the dict returned by DataLoader.state_dict()"
            )
        if "datasets" in state:
            if len(state["datasets"]) != len(self._volumes):
                raise DataError(
                    f"the saved state holds {len(state['datasets'])} VolumeDataset positions but "
                    f"this loader reads {len(self._volumes)}; build the loader the same way"
                )
            for vd, sub in zip(self._volumes, state["datasets"], strict=True):
                vd.load_state_dict(sub)
        elif callable(load := getattr(self.dataset, "load_state_dict", None)):
            load(state["dataset"])
        else:
            raise DataError(
                f"the loader's dataset ({type(self.dataset).__name__}) cannot load a position; "
                "give it load_state_dict() or keep the VolumeDataset as an attribute"
            )

    # --- lifetime -------------------------------------------------------------------

    def _stop_workers(self) -> None:
        iterator = _torch_compat.take_loader_iterator(self)
        if iterator is not None:
            _torch_compat.shutdown_workers(iterator)
        self._workers_expect = None

    def close(self) -> None:
        """Stop the persistent workers now (they also stop when the loader is deleted)."""
        self._stop_workers()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
