"""``CheckpointManager``: periodic async saves, retention and exact resume under one root.

Example:
    >>> ckpt = CheckpointManager("/mnt/vol/run1/checkpoints", every=100, keep=3)
    >>> start = ckpt.restore(model=model, optimizer=opt, data=loader)  # doctest: +SKIP
    >>> for step in range(start, total_steps):  # doctest: +SKIP
    ...     train_step()
    ...     ckpt.maybe_save(step, model=model, optimizer=opt, data=loader)
    >>> ckpt.close()  # doctest: +SKIP

World-size changes: model and optimizer state reshard through DCP. Per-rank
state (RNG streams, the state of other stateful objects, extra) of new rank r
is the one saved by old rank r when it existed, else old rank 0's; ranks added
by a larger world therefore start with rank 0's RNG streams (reseed them with
the rank mixed in if they must differ).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nbtools import events, runtime
from nbtools._internal.log import get_logger
from nbtools._internal.runinfo import active_mlflow_run_id
from nbtools.checkpoint import _objects
from nbtools.checkpoint._checks import check_extra, check_step, check_writable
from nbtools.checkpoint._collective import release_groups
from nbtools.checkpoint._config import CheckpointConfig
from nbtools.checkpoint._lease import AFTER_RECOVERY_S, WriterLease
from nbtools.checkpoint._live import LiveTier
from nbtools.checkpoint._memory import MemoryTier, peers
from nbtools.checkpoint._meta import find_meta, rank_device
from nbtools.checkpoint._restore import Restorer, Tier
from nbtools.checkpoint._saver import Saver
from nbtools.checkpoint._storage import Target, check_root, scratch
from nbtools.checkpoint._volume_tier import VolumeTier
from nbtools.checkpoint.discovery import RootCheck
from nbtools.errors import CheckpointError

__all__ = ["CheckpointManager"]

_log = get_logger("checkpoint")


class CheckpointManager:
    """Saves and restores training state under ``root/step_<N>/``.

    One run saves into a root at a time: the first save takes a lease
    (``root/.nbtools-writer``, renewed in the background and removed by
    ``close``), and a second run saving into the same root gets a
    ``CheckpointError`` naming the first, instead of the two deleting each
    other's checkpoints. A lease is live while its writer renews it: on this
    machine, its process (pid and start time) still runs and renewed it within a
    minute; on another machine, it changes within 30 s. That is watched in the
    background from the moment the manager is created: a save due before the
    verdict is deferred (``maybe_save`` saves at the first step after it), never
    blocked. Take a root over from a run known to be gone with
    ``takeover=True``, or by deleting ``root/.nbtools-writer``.

    Args:
        root: Directory (local, NFS, FUSE) or fsspec URL holding the checkpoints.
        every: ``maybe_save`` saves when ``step % every == 0``; None: only ``save`` saves.
        keep: Complete checkpoints to keep (older ones are deleted in the
            background); None keeps all.
        async_save: Save in the background with ``dcp.async_save`` (the caller is
            blocked only while the state is copied into reused staging buffers).
        staging_dir: Local staging directory (default ``NBTOOLS_STAGING_DIR`` or temp dir).
        sync_files: fsync shards before publishing ``.metadata``.
        save_on_close: ``close()`` (and leaving a ``with`` block without an
            exception) saves the last step given to ``maybe_save`` when it is
            newer than the last checkpoint, so a finished run never repeats its
            tail. The objects are saved as they are at that moment.
        takeover: Take the root's writer lease even when its holder looks alive
            (it stops saving at its next heartbeat or save). For a root whose
            previous writer is known to be gone.
        memory_every: ``maybe_save`` also snapshots the same state into node-local
            shared memory (``/dev/shm``, or ``NBTOOLS_SNAPSHOT_DIR``) when
            ``step % memory_every == 0``; the snapshots outlive a killed rank, and
            ``restore`` loads the newest step every rank can get from there when it
            is at least as new as the volume's. None (the default): no snapshots.
        replicas: With ``memory_every``, how many peer ranks also hold each rank's
            snapshot, on other nodes (the same local rank on the next nodes), sent
            in the background over the job's process group; a rank whose own
            snapshot is lost (its node gone, its slot damaged) restores from a
            peer's. None (the default): 1 when the job spans several nodes, else 0.
            Asked for explicitly on a single node, the next ranks hold them.
        config: All of the settings above in one :class:`CheckpointConfig`, checked
            when it was made (then pass none of them as keyword arguments).

    Attributes:
        config: The settings, as one frozen :class:`CheckpointConfig`.
        restored_step: Step of the checkpoint ``restore`` loaded, or None.
        restored_tier: Where ``restore`` loaded this rank's state from: ``"memory"``
            (its own snapshot), ``"replica"`` (a peer's copy of it) or ``"volume"``
            (None before a restore, or when there was nothing).
        last_saved_step: Step of the last checkpoint completed and published
            (by this manager, or the one restored).
        mlflow_run_id: MLflow run id of the restored checkpoint or of the last save
            (the active run then, else the one before), or None.
        extra: The ``extra`` dict recorded in the restored checkpoint.
        skipped: ``(checkpoint, reason)`` for each newer checkpoint ``restore``
            passed over because its data did not verify.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every: int | None = None,
        keep: int | None = None,
        async_save: bool = True,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        sync_files: bool = True,
        save_on_close: bool = True,
        takeover: bool = False,
        memory_every: int | None = None,
        replicas: int | None = None,
        config: CheckpointConfig | None = None,
    ) -> None:
        self.config = CheckpointConfig.of(
            config,
            every=every,
            keep=keep,
            async_save=async_save,
            staging_dir=staging_dir,
            sync_files=sync_files,
            save_on_close=save_on_close,
            takeover=takeover,
            memory_every=memory_every,
            replicas=replicas,
        )
        config = self.config
        self.every = config.every
        self.memory_every = config.memory_every
        self.replicas = config.replicas
        if self.replicas is None:
            nodes, _ = peers(runtime.get_world_size(), runtime.get_local_world_size())
            self.replicas = 1 if nodes > 1 else 0
        self.keep = config.keep
        self._root = RootCheck(root)  # an object store's is checked in the background
        self._target: Target = self._root.target
        check_writable(self._target)
        check_root(self._target)  # a root other users can write: planted checkpoints
        self.root = self._target.url
        self.async_save = config.async_save
        self.save_on_close = config.save_on_close
        staging_dir = config.staging_dir
        self._staging_dir = staging_dir
        # What a killed run's save left in the staging directory goes now, not at the
        # next save: a run may restore and train long before it saves.
        scratch.sweep(scratch.staging_base(staging_dir))
        self._sync_files = config.sync_files
        self.restored_step: int | None = None
        self.restored_tier: str | None = None
        self.extra: dict[str, Any] = {}
        self.skipped: list[tuple[str, str]] = []
        # Saves run collectives from a background thread: they get their own gloo group
        # so they never interleave with the training loop's collectives.
        self._pg = dist.new_group(backend="gloo") if runtime.is_distributed() else None
        main = runtime.get_rank() == 0
        self._lease = WriterLease(self._target, config.takeover) if main else None
        if self._lease is not None and self._target.local_path is not None:
            self._lease.probe()  # a local lease is read now; an object store's later (_probe)
        # A manager dropped without close() (a notebook cell run again) frees the root.
        self._release = weakref.finalize(self, self._lease.release if self._lease else lambda: None)
        self._memory = (
            MemoryTier(self.memory_every, self.root, self.replicas) if self.memory_every else None
        )
        self._saver = Saver(
            self._root,
            self._pg,
            self._lease,
            self._memory,
            keep=self.keep,
            async_save=config.async_save,
            staging_dir=staging_dir,
            sync_files=config.sync_files,
        )
        # The tiers a restore asks, fastest first (see ``_restore``); the volume answers last.
        self._volume = VolumeTier(self._root, self._saver, staging_dir, self._lease)
        self._tiers: list[Tier] = [self._memory] if self._memory is not None else []
        self._tiers.append(self._volume)
        # A group that heals in place: the state the ranks that kept their processes hold.
        self._live = LiveTier(lambda: self._saver.last_saved_step) if LiveTier.active() else None
        if self._live is not None:
            self._tiers.insert(0, self._live)
        self._failed = False  # closed on an error: snapshots stay for the restart
        self._closed = False
        self._checked = False  # the objects of the first save call passed check_objects

    @property
    def last_saved_step(self) -> int | None:
        """Step of the last checkpoint completed and published (or restored), or None."""
        return self._saver.last_saved_step

    @last_saved_step.setter
    def last_saved_step(self, step: int | None) -> None:
        self._saver.last_saved_step = step

    @property
    def mlflow_run_id(self) -> str | None:
        """MLflow run id of the restored checkpoint or of the last save, or None."""
        return self._saver.mlflow_run_id

    @mlflow_run_id.setter
    def mlflow_run_id(self, run_id: str | None) -> None:
        self._saver.mlflow_run_id = run_id

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one")

    def _probe(self) -> None:
        """Read an object store's writer lease in the background (see ``_lease``)."""
        if self._lease is not None:
            self._lease.probe()

    # --- restore -------------------------------------------------------------

    def restore(
        self,
        *,
        planner: Any = None,
        init: Callable[[torch.nn.Module], None] | None = None,
        device: str | torch.device | None = None,
        **objs: Any,
    ) -> int:
        """Load the newest checkpoint that verifies into ``objs``; return the next step to run.

        A checkpoint whose data does not match its recorded checksums is skipped
        with a warning naming it and the reason (also listed in ``skipped``), and
        the next older one is tried.

        Each stored byte range that several ranks need is read from the volume
        once per job and handed to them over the process group (see
        :class:`~nbtools.checkpoint.VolumeReader`).

        Args:
            planner: A DCP ``LoadPlanner`` for the model and optimizer state
                (None: ``DefaultLoadPlanner``).
            init: For models built on the meta device (``with torch.device("meta"):``):
                ``init(model)`` initialises one on a fresh start (nothing to restore).
                None: each module that holds meta tensors calls its
                ``reset_parameters()``. Such a model's meta tensors first get empty
                storage on ``device``, keeping the parameters' identity (an
                optimizer built on the meta model is valid), and a restore fills them
                without a random initialisation to overwrite.
            device: Where meta tensors get their storage (None: the rank's GPU
                when the process group runs NCCL, else torch's default device, the
                CPU unless set).
            **objs: Models, optimizers and stateful objects by name, as given to ``save``.

        Returns:
            Saved step + 1, or 0 when there is no checkpoint.

        Raises:
            CorruptCheckpointError: Checkpoints exist but none verifies (``objs``
                may then hold partly loaded values).
            CheckpointError: A model built on the meta device cannot be completed:
                a non-persistent buffer on it (no checkpoint holds it), or, without
                ``init``, a module with meta tensors and no ``reset_parameters()``.
        """
        self._check_open()
        kinds = _objects.classify(objs)
        metas = find_meta(kinds.models, init)
        for meta in metas:
            meta.materialize(torch.device(device) if device is not None else rank_device())
        step = self._restore(planner, kinds)
        if step == 0:
            for meta in metas:
                meta.initialize(init)
        return step

    def _restore(self, planner: Any, kinds: _objects.Objects) -> int:
        self.wait()
        scratch.sweep(scratch.staging_base(self._staging_dir))  # a killed writer's leftovers
        with events.phase("restore"):
            restored = Restorer(self._tiers, self._pg).restore(kinds, planner)
        if restored.tier in ("live", "memory", "replica") and self._lease is not None:
            self._lease.defer_probe(AFTER_RECOVERY_S)  # the first steps of the recovery run first
        self.restored_step, self.restored_tier = restored.step, restored.tier
        self.skipped = restored.skipped
        if restored.step is None:
            return 0
        self.last_saved_step = restored.saved_step
        self.extra = dict(restored.blob.get("extra") or {})
        self.mlflow_run_id = restored.mlflow_run_id
        return restored.step + 1

    # --- save ------------------------------------------------------------------

    def maybe_save(self, step: int, *, extra: dict[str, Any] | None = None, **objs: Any) -> bool:
        """Save when ``step % every == 0``; returns whether a save was started.

        Every call is remembered: ``close()`` saves the last step seen when it
        is newer than the last checkpoint (see ``save_on_close``). Raises the
        error of a failed background save even when no save is due.
        """
        self._check_open()
        check_step(step)
        events.step(step)  # a loop that saves through the manager is seen progressing
        check_extra(extra)
        self._check_objects(objs)
        self._saver.raise_failed()
        self._probe()
        self._saver.remember(step, objs, extra)
        if self._live is not None:
            self._live.snapshot(step, objs, extra, self.mlflow_run_id)
        if self._memory is not None and self._memory.due(step):
            run_id = active_mlflow_run_id() or self.mlflow_run_id
            with events.phase("snapshot"):  # a long phase, not a hang, for the kernel's watch
                self._memory.snapshot(step, objs, extra, run_id)
        if not self._saver.deferred and (self.every is None or step % self.every != 0):
            return False
        with events.phase("save"):
            return self._volume.snapshot(step, objs, extra, None)

    def save(self, step: int, *, extra: dict[str, Any] | None = None, **objs: Any) -> bool:
        """Checkpoint ``objs`` as ``step`` (asynchronously unless ``async_save=False``).

        Waits for the previous save first (one save in flight). When this
        returns, the objects may be changed: the checkpoint holds their values
        at the moment of the call. A complete checkpoint of ``step`` already
        under root is replaced atomically (until the new one is published, the
        old one stays complete). A save that fails leaves no new ``step_<N>``
        directory behind. Returns True; returns False, with a warning, while
        another machine's lease on the root is still being watched: the save
        is deferred to the next ``maybe_save`` (or ``close``).

        Raises:
            CheckpointError: The save failed, or another run is saving into
                this root (see the class docstring).
        """
        self._check_open()
        check_step(step)
        events.step(step)
        self._check_objects(objs)
        with events.phase("save"):
            return self._volume.snapshot(step, objs, extra, None)

    def _check_objects(self, objs: dict[str, Any]) -> None:
        """Refuse at the first save call what no restore could put back (a wrapper not
        understood), instead of after the first crash."""
        if not self._checked:
            _objects.check_objects(objs)
            self._checked = True

    def wait(self) -> None:
        """Block until the save in flight (if any) is published and the memory snapshot being
        written (if any) is complete; raise the save's error if it failed."""
        with events.phase("save"):
            self._saver.wait()

    def close(self, *, final_save: bool | None = None) -> None:
        """Finish the save in flight, save the last step reached, release everything.

        Releasing includes the process groups the manager made (after every rank
        reached its close, on a clean close): a notebook may make a manager per cell.

        Args:
            final_save: Save the last step given to ``maybe_save`` when it is
                newer than the last checkpoint; None: as ``save_on_close`` says.
                On the exit of a ``with`` block by an exception it is False.
        """
        if self._closed:
            return
        finished = False
        try:
            self.wait()
            if self.save_on_close if final_save is None else final_save:
                with events.phase("save"):
                    self._saver.save_last_seen()
            finished = not self._failed
        finally:
            self._closed = True
            for tier in self._tiers:  # the volume last: its saves are finished
                tier.close(keep=not finished)
            self._release()
            self._release_groups(finished)

    def _release_groups(self, finished: bool) -> None:
        """Destroy the process groups this manager made: a notebook that makes a manager
        per cell (or per call of a kept pool) must not grow by their sockets and threads.
        A clean close first waits for every rank there (see ``release_groups``)."""
        groups = [self._pg, self._memory.group if self._memory is not None else None]
        if release_groups(groups, sync=self._pg if finished else None):
            self._pg = self._saver.pg = None
            if self._memory is not None:
                self._memory.group = None
                self._memory.exchanging = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._failed = True
        try:
            self.close(final_save=False)  # the state after a failure is not a finished step
        except Exception as close_exc:  # noqa: BLE001 - keep the original error
            _log.warning("closing the checkpoint manager failed too: %s", close_exc)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, every={self.every}, keep={self.keep})"
