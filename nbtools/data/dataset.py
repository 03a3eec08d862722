"""``VolumeDataset``: the files of a slow volume, served as paths of local cached copies."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import IO, Any

from torch.utils.data import IterableDataset, get_worker_info

from nbtools import runtime
from nbtools._internal.location import is_url
from nbtools._internal.log import get_logger
from nbtools.data._cache import FileCache, default_cache_dir
from nbtools.data._listing import Index, Opener, job_token, load_index, namespace, open_index
from nbtools.data._plan import (
    IterationPlan,
    check_same_batches,
    check_same_workers,
    dist_info,
    gather,
)
from nbtools.data._positions import Consumed, Order
from nbtools.data._stream import (
    Item,
    SourceCheck,
    StreamSpec,
    check_mode,
    check_window,
    serve,
    slot_items,
    track,
)
from nbtools.errors import DataError

__all__ = ["VolumeDataset"]


_log = get_logger("data.dataset")

#: 2: shuffled orders come from ``_positions.Order``; a version-1 state of a
#: shuffled dataset counted positions in another order and is refused.
_STATE_VERSION = 2
_UNSHUFFLED_STATES = (1,)  # versions whose unshuffled positions mean the same


def _refuse_in_worker(method: str) -> None:
    """Fail at once where a collective would hang: in a loader's worker process."""
    info = get_worker_info()
    if info is None:
        return
    raise DataError(
        f"VolumeDataset.{method}() was called in loader worker {info.id} of {info.num_workers} "
        f"on rank {runtime.get_rank()}: the position in the epoch is agreed by all ranks' "
        "training processes, which a worker cannot join, so a loader that saves its "
        "dataset's state in its workers (torchdata's StatefulDataLoader) cannot resume it. "
        "Iterate it through nbtools.data.DataLoader (pass data=loader to CheckpointManager), "
        "or use num_workers=0"
    )


def _check_shares(shares: tuple[int, ...], world: int, remaining: int, drop_last: bool) -> None:
    """Fail at the start of an iteration whose global batches the ranks cannot take."""
    if len(shares) != world:
        raise DataError(
            f"the loader split its global batch of {sum(shares)} over {len(shares)} ranks, but "
            f"the process group now has {world}: build the DataLoader after the process group "
            "is initialised, in the same launch that iterates it"
        )
    rest = remaining % sum(shares)
    if not drop_last and 0 < rest < world:
        raise DataError(
            f"the epoch ends with {rest} samples after its last whole global batch of "
            f"{sum(shares)}, fewer than the {world} ranks: some rank would get no sample in the "
            "last step. Pass drop_last=True to skip them, or a global_batch_size that leaves at "
            f"least {world}"
        )


class VolumeDataset(IterableDataset[Any]):
    """The files under ``root``, yielded as paths of complete local copies.

    The first access to a file copies it from the (slow) volume to a local
    cache; later epochs reuse the copy. Copies run up to ``prefetch`` files
    ahead of the consumer on threads, overlapping the training step. Files are
    split over ``world_size x num_workers`` slots with a global stride, rank and
    world size read from ``torch.distributed`` when iteration starts.

    A yielded path is ephemeral: when the cache filesystem runs short of space,
    files are evicted (oldest download first), and only the path yielded last,
    the copies not yet served, and the paths in batches an nbtools
    ``DataLoader`` may still hold are protected. Open, decode or copy each path
    in the same iteration step that receives it; never keep paths for later.

    Args:
        root: A directory, a mounted volume, or an fsspec URL.
        pattern: Glob relative to ``root`` (``**`` crosses directories); hidden
            files are skipped.
        cache_dir: Local cache directory, shared by every worker and rank on
            the node, private to the user (mode 0700; a directory another user
            owns or can write to is refused). Default: ``$NBTOOLS_CACHE_DIR``,
            else ``$XDG_CACHE_HOME/nbtools``, else ``~/.cache/nbtools``.
        shuffle: Serve the files in an order that is a deterministic function
            of ``(seed, epoch)``.
        seed: Seed of the shuffle.
        prefetch: How many files each stream copies ahead (and copy threads).
            On a cache too small for that many files per stream, fewer are
            copied ahead (at least one), with a warning.
        min_free_bytes: Free space to keep on the cache filesystem (default
            ``NBTOOLS_CACHE_MIN_FREE_BYTES`` or ``SGC_FSLAYER_MIN_FREE_DISK_BYTES``,
            else 10 % of the filesystem).
        refresh: List the root again even when the index of an earlier launch
            looks fresh (once per job: the other ranks use the new listing).
            Needed on mounts whose directory modification times do not change.
        check_sources: When to ``stat`` the source of a cached copy before serving
            it, so that a file rewritten in place (same name, other size or
            mtime) is copied again, never served stale. ``"launch"`` (the
            default): each source once per launch, in the first epoch this
            dataset serves whole (and in the part-epoch a resumed run starts
            with); later epochs of the launch trust what that pass saw, so a
            file rewritten in place during a launch is seen by the next
            launch. ``"epoch"`` (or ``True``): every source in every epoch,
            one metadata request to the volume per file and epoch. ``False``:
            never; the listing's sizes and mtimes are trusted. Checks run on a
            thread of the stream, ahead of the consumer.
        index_in_root: Also keep the index in the root (``.nbtools-index/``, a
            hidden directory the listing skips), so that other nodes and later
            jobs copy it instead of listing the volume again, wherever they
            mount it (its paths are relative). An index found there is used
            only when it belongs to you, nobody else can write to it, it
            passes its checks (format, pattern, checksums, every path inside
            the root) and it is fresh; otherwise the root is listed again, with
            a warning for a refused one. Nodes that start at the same moment
            list the root once: one holds a listing lease there while the
            others wait for its index. A root you cannot write is listed per
            node, with one warning. Local roots and mounts only (not fsspec
            URLs).

    The list of files is an index in the cache directory, built by one process
    per node and memory-mapped by every rank and loader worker; a later launch
    reuses it when no listed directory changed (one ``stat`` per directory). A
    file rewritten in place is seen when served: its size and mtime are
    compared with its cached copy's.

    Example:
        >>> files = VolumeDataset("/mnt/vol/images", "**/*.jpg", shuffle=True)  # doctest: +SKIP
        >>> for epoch in range(start_epoch, epochs):  # doctest: +SKIP
        ...     files.set_epoch(epoch)
        ...     for path in files:
        ...         image = decode(path)  # open the path now; it may be evicted later
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        pattern: str = "**/*",
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        prefetch: int = 16,
        min_free_bytes: int | None = None,
        refresh: bool = False,
        check_sources: bool | str = "launch",
        index_in_root: bool = False,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path or URL string, got {type(root).__name__}")
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a glob string such as '**/*', got {pattern!r}")
        if not pattern:
            raise ValueError("pattern must be a non-empty glob such as '**/*'")
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a path, got {type(cache_dir).__name__}")
        for name, value in (("seed", seed), ("prefetch", prefetch)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 (files copied ahead), got {prefetch}")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        if min_free_bytes is not None:
            if not isinstance(min_free_bytes, int) or isinstance(min_free_bytes, bool):
                raise TypeError(
                    f"min_free_bytes must be an int (bytes), got {type(min_free_bytes).__name__}"
                )
            if min_free_bytes < 0:
                raise ValueError(f"min_free_bytes must not be negative, got {min_free_bytes}")
        self.root = os.fspath(root)
        self.pattern = pattern
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.prefetch = prefetch
        self.min_free_bytes = min_free_bytes
        self.refresh = bool(refresh)
        self.check_sources = check_mode(check_sources)
        self.index_in_root = bool(index_in_root)
        self._uid = IterationPlan.new_id()
        self._files: Index | None = None
        # Where a copy of this dataset in another process maps the same index.
        self._index_at: tuple[str, str, str, list[int]] | None = None
        self._fs: Any = None
        self._cache: FileCache | None = None
        # Position: the epoch, what was consumed before the current plan, and
        # what the consumer received under it (slot -> count).
        self._epoch = 0
        self._consumed = Consumed()
        self._plan: IterationPlan | None = None
        self._counts: dict[int, int] = {}
        self._batches = 0  # batches a loader received under the current plan
        # Layout of the run a position was saved from: rotations per rank, to
        # keep the batch order when resuming with the same layout.
        self._layout: dict[str, Any] | None = None
        self._explicit_epoch: int | None = None
        # A plan handed to the next ``__iter__`` (possibly in a worker copy), and
        # the last plan a worker copy served.
        self._pending: IterationPlan | None = None
        self._last_plan: IterationPlan | None = None
        # Whether the next epoch looks at its sources (see ``check_sources``).
        self._checking = self.check_sources != "never"

    # --- public -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch being served (or the one the next iteration serves after ``set_epoch``)."""
        return self._explicit_epoch if self._explicit_epoch is not None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next. The current epoch keeps its position (a resumed run
        calls ``set_epoch`` with the epoch it restored); another epoch starts from
        its beginning. Without ``set_epoch`` a finished epoch is followed by the next."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._explicit_epoch = epoch

    def __len__(self) -> int:
        """Number of files in the dataset (all ranks together)."""
        return len(self._listing())

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch, independent of world size and number of workers.

        Plain Python (ints, strings, lists). With a process group of several
        ranks this is a collective: call it on every rank; every rank gets the
        same state, which any rank can restore with any world size.

        Raises:
            DataError: Called inside a loader worker, where no collective can run
                (a loader that saves its dataset's state in its workers, such as
                torchdata's ``StatefulDataLoader``).
        """
        _refuse_in_worker("state_dict")
        files = self._listing()
        epoch, consumed, layout = self._current(files)
        if self._explicit_epoch is not None and self._explicit_epoch != epoch:
            epoch, consumed, layout = self._explicit_epoch, Consumed(), None
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "prefix": consumed.prefix,
            "extras": list(consumed.extras),
            "num_files": len(files),
            "fingerprint": files.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "layout": layout,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict` (any world size or workers)."""
        _refuse_in_worker("load_state_dict")
        version = state.get("version") if isinstance(state, dict) else None
        if version != _STATE_VERSION and version not in _UNSHUFFLED_STATES:
            raise ValueError(
                "not a VolumeDataset state (expected the dict returned by state_dict(), "
                f"version {_STATE_VERSION}); got {type(state).__name__}"
            )
        files = self._listing()
        if state["num_files"] != len(files) or state["fingerprint"] != files.fingerprint:
            raise DataError(
                f"the saved position belongs to a listing of {state['num_files']} files "
                f"(fingerprint {state['fingerprint']}), but {self.root!r} with pattern "
                f"{self.pattern!r} now lists {len(files)} files (fingerprint {files.fingerprint}): "
                "files were added, removed or renamed since, and its positions would name other "
                "files. Resume over the files it was saved with, or start the epoch afresh: "
                "restore without the data position (leave data= out of CheckpointManager.restore)"
            )
        if version != _STATE_VERSION and state.get("shuffle"):
            raise DataError(
                f"the saved position (state version {version}) counts files in the shuffled "
                "order of an earlier nbtools, which this one no longer computes; resuming it "
                "would serve other files. Start the epoch afresh: restore without the data "
                "position (leave data= out of CheckpointManager.restore)"
            )
        if state["seed"] != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise DataError(
                f"the saved position was taken with shuffle={state['shuffle']}, seed={state['seed']}; "
                f"this dataset has shuffle={self.shuffle}, seed={self.seed}. Construct it with the "
                "same shuffle and seed to resume"
            )
        prefix, extras = int(state["prefix"]), {int(e) for e in state["extras"]}
        if not 0 <= prefix <= len(files) or any(not prefix < e < len(files) for e in extras):
            raise ValueError(
                f"the saved position is inconsistent (prefix {prefix}, {len(extras)} extras, "
                f"{len(files)} files); pass the dict state_dict() returned, unmodified"
            )
        self._epoch = int(state["epoch"])
        self._consumed = Consumed.from_positions(prefix, extras)
        self._plan, self._counts, self._batches = None, {}, 0
        layout = state.get("layout")
        self._layout = dict(layout) if isinstance(layout, dict) else None
        self._explicit_epoch = self._pending = None

    def __iter__(self) -> Iterator[str]:
        info = get_worker_info()
        if info is None:
            plan, self._pending = self._pending, None
            if plan is None:
                plan = self._prepare(num_workers=1, tracked=False)
            worker_id = 0
        else:
            plan = self._worker_plan(info.num_workers)
            worker_id = info.id
        return self._serve(plan, plan.slot_of(worker_id))

    # --- planning (training process) ----------------------------------------------------

    def _listing(self) -> Index:
        if self._files is None:
            if self._index_at is not None:
                path, root, fingerprint, checked = self._index_at
                # The same version of the file is not read in full again.
                files = open_index(path, root, self.pattern, checked)
                if files.fingerprint != fingerprint:
                    raise DataError(
                        f"the index of {self.root!r} changed while this dataset was in use "
                        "(another job listed it again); start the loader again"
                    )
            else:
                token = job_token(fallback=self._uid)
                where = (self.root, self.pattern, self.cache_dir, self.refresh)
                files = load_index(*where, token, self.index_in_root)
                self._index_at = (files.path, files.root, files.fingerprint, files.identity)
            self._files = files
        return self._files

    def _current(self, files: Index) -> tuple[int, Consumed, dict[str, Any] | None]:
        """The epoch, everything consumed in it over all ranks, and the layout.

        One collective on every rank, whatever the local state.
        """
        plan = self._plan
        rotation = 0 if plan is None else (plan.rotation + self._batches) % plan.num_workers
        parts = gather((self._counts, rotation))
        if plan is None:
            return self._epoch, self._consumed, self._layout
        counts: dict[int, int] = {}
        for part, _ in parts:
            counts.update(part)
        layout = {
            "world_size": plan.world_size,
            "num_workers": plan.num_workers,
            "rotation": [r for _, r in parts],
        }
        return self._epoch, plan.consumed_after(len(files), counts), layout

    def _prepare(
        self,
        num_workers: int,
        tracked: bool,
        reuse: IterationPlan | None = None,
        hold: int | None = None,
        shares: tuple[int, ...] | None = None,
        drop_last: bool = False,
    ) -> IterationPlan:
        """Decide what the next iteration serves; a collective on every rank.

        ``hold``: batches a loader may still hold besides the one being filled
        (see ``_stream._stream``). ``shares``: each rank's part of a loader's
        global batch (``drop_last``: skip the smaller last one). Returns
        ``reuse`` itself when it would serve exactly the same work.
        """
        files = self._listing()
        agreed = gather((num_workers, None if shares is None else sum(shares)))
        check_same_workers([workers for workers, _ in agreed])
        check_same_batches([batch for _, batch in agreed])
        epoch, consumed, layout = self._current(files)
        previous = self._plan
        if previous is not None and previous.epoch == epoch and consumed.is_complete(len(files)):
            self._checking = previous.next_checks()  # the epoch was served whole
        if self._explicit_epoch is not None:
            if self._explicit_epoch != epoch:
                epoch, consumed = self._explicit_epoch, Consumed()
        elif consumed.is_complete(len(files)):
            epoch, consumed = epoch + 1, Consumed()
        rank, world = dist_info()
        if shares is not None:
            _check_shares(shares, world, len(files) - consumed.count(), drop_last)
        rotation = 0
        if (
            shares is None
            and consumed.count()
            and layout
            and (layout["world_size"], layout["num_workers"]) == (world, num_workers)
        ):
            rotation = int(layout["rotation"][rank]) % num_workers
        # fmt: off
        plan = IterationPlan(
            IterationPlan.new_id(), epoch, consumed, rank, world, num_workers, tracked, rotation,
            hold, check=self._checking, recheck=self.check_sources == "epoch", shares=shares,
            drop_last=drop_last,
        )
        # fmt: on
        if plan.same_work(reuse):
            plan = reuse  # type: ignore[assignment]
        self._epoch, self._consumed, self._plan, self._counts = epoch, consumed, plan, {}
        self._batches, self._layout, self._explicit_epoch = 0, None, None
        return plan

    def _record(self, plan_id: str, slot: int, count: int) -> None:
        """The consumer received ``count`` paths of ``slot`` under ``plan_id``."""
        if self._plan is not None and self._plan.plan_id == plan_id:
            self._counts[slot] = max(self._counts.get(slot, 0), count)

    def _record_batch(self) -> None:
        """The consumer received one more batch from the loader."""
        self._batches += 1

    def _finish_local(self) -> None:
        """The consumer reached the end: every slot of this rank counts as consumed."""
        plan = self._plan
        if plan is not None:
            n = len(self._listing())
            for slot in plan.slots():
                self._counts[slot] = plan.slot_length(n, slot)

    # --- serving (any process) ----------------------------------------------------------

    def _worker_plan(self, num_workers: int) -> IterationPlan:
        """The plan of a loader worker's copy of this dataset."""
        plan, self._pending = self._pending, None
        if plan is None and self._last_plan is not None:
            plan = self._last_plan.advanced()  # persistent worker, next epoch
        if plan is None:
            # Driven by a loader that does not plan (e.g. torch's own): use the
            # position this copy was made with.
            rank, world = runtime.get_rank(), runtime.get_world_size()
            epoch = self._explicit_epoch if self._explicit_epoch is not None else self._epoch
            base = self._consumed if epoch == self._epoch else Consumed()
            # fmt: off
            plan = IterationPlan(
                IterationPlan.new_id(), epoch, base, rank, world, num_workers, False,
                check=self.check_sources != "never", recheck=self.check_sources == "epoch",
            )
            # fmt: on
        if plan.num_workers != num_workers:
            raise DataError(
                f"the dataset was planned for {plan.num_workers} workers but runs in a loader "
                f"with {num_workers}; iterate it through nbtools.data.DataLoader"
            )
        self._last_plan = plan
        return plan

    def _items(self, plan: IterationPlan, slot: int) -> Iterator[list[Item]]:
        """The files of ``slot`` in serving order, in chunks (see ``_items.slot_items``)."""
        files = self._listing()
        order = Order(len(files), self.seed, plan.epoch, self.shuffle)
        return slot_items(files, order, plan.chunks(len(files), slot))

    def _source_checker(self, plan: IterationPlan) -> SourceCheck | None:
        """What gives items their source's size and mtime now (None: trust the listing).

        The stream runs it on a thread of its own ahead of the consumer, so a
        cached copy whose source was rewritten in place is copied again.
        """
        files = self._listing()
        if not plan.check or is_url(files.root):
            return None
        return SourceCheck(files.root, len(namespace(files.root)) + 1)

    def _open_source(self, index: int) -> IO[bytes]:
        """Open the source of file ``index`` of the listing (to copy it into the cache)."""
        files = self._listing()
        if self._fs is None and is_url(files.root):
            from fsspec.core import url_to_fs

            self._fs = url_to_fs(files.root)[0]
        return Opener(files.source(index), self._fs)()

    def _stat_source(self, index: int) -> tuple[int, int] | None:
        """``(size, mtime_ns)`` of the source of file ``index`` now, or None (a URL, or gone)."""
        files = self._listing()
        if is_url(files.root):
            return None
        try:
            st = os.stat(files.source(index))
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def _open_cache(self) -> FileCache:
        if self._cache is None:
            self._cache = FileCache(self.cache_dir, self.min_free_bytes)
        return self._cache

    def _stream_share(self, num_workers: int) -> tuple[int, int]:
        """``(bytes, largest file)``: the share of the cache of one stream on this node.

        Every loader worker of every rank on the node runs one stream over the
        same cache, so each may protect ``capacity / streams`` bytes at once,
        less a twentieth for the filesystem's own metadata.
        """
        streams = max(1, num_workers) * max(1, runtime.get_local_world_size())
        largest = self._listing().largest
        capacity = self._open_cache().capacity
        return (capacity - capacity // 20) // streams, largest

    def _serve(self, plan: IterationPlan, slot: int) -> Iterator[str]:
        info = get_worker_info()
        budget, largest = self._stream_share(info.num_workers if info is not None else 1)
        check_window(self._open_cache(), budget, largest, self.prefetch)
        self_counting = not plan.tracked and get_worker_info() is None
        count = track(self._uid, plan.plan_id, slot)

        def on_yield() -> None:
            self._record(plan.plan_id, slot, count.n)

        spec = StreamSpec(
            cache=self._open_cache(),
            open_source=self._open_source,
            prefetch=self.prefetch,
            count=count,
            on_yield=on_yield if self_counting else None,
            budget=budget,
            hold=plan.hold,
            stat_source=self._stat_source,
            check=self._source_checker(plan),
        )
        return serve(spec, self._items(plan, slot))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None
        state["_fs"] = None
        state["_files"] = None  # a map: the copy maps the same file again
        return state

    def __repr__(self) -> str:
        return (
            f"VolumeDataset({self.root!r}, {self.pattern!r}, cache_dir={self.cache_dir!r}, "
            f"shuffle={self.shuffle}, seed={self.seed})"
        )
