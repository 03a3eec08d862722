"""The manager's volume saves, start to publish: :class:`Saver`.

:meth:`Saver.save` agrees with every rank on what the save may do (go ahead,
wait for the root's writer lease, refuse, or atomically replace a checkpoint of
the same step), builds the state, and writes it through a :class:`VolumeWriter`,
in the background with ``dcp.async_save`` unless ``async_save=False``; the step
is published (``last_saved_step``, the ``checkpoint_saved`` report, retention)
when the write completes. :meth:`Saver.save_last_seen` is the final save of
``close``. The :class:`~nbtools.checkpoint.CheckpointManager` owns one.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nbtools import runtime
from nbtools._internal.log import get_logger
from nbtools._internal.runinfo import active_mlflow_run_id
from nbtools.checkpoint import _objects, _report, _state
from nbtools.checkpoint._checks import SaveCase, SaveVerdict, check_extra, save_verdict
from nbtools.checkpoint._collective import agree, final_step
from nbtools.checkpoint._dcp import quiet_single_process_warning, unwrap
from nbtools.checkpoint._forks import track
from nbtools.checkpoint._host_buffers import ReusableStager
from nbtools.checkpoint._lease import WriterLease
from nbtools.checkpoint._memory import MemoryTier
from nbtools.checkpoint._report import SaveTiming
from nbtools.checkpoint._retention import RetentionWorker
from nbtools.checkpoint._storage import METADATA_NAME, step_dir_name
from nbtools.checkpoint.discovery import RootCheck, is_foreign
from nbtools.checkpoint.writer import VolumeWriter

__all__ = ["Saver"]

_log = get_logger("checkpoint")


class Saver:
    """One manager's volume saves: one in flight at a time, published when complete.

    Args:
        root: The root being checked (an object store's in the background).
        pg: The gloo group the saves' collectives run on (None: one process).
        lease: The root's writer lease (rank 0 only, else None).
        memory: The memory tier told of each volume save, and waited for with it.
        keep: Complete checkpoints to keep (retention runs on rank 0); None keeps all.
        async_save: Save in the background with ``dcp.async_save``.
        staging_dir: Local staging directory for the writer.
        sync_files: fsync shards before publishing ``.metadata``.
    """

    def __init__(
        self,
        root: RootCheck,
        pg: dist.ProcessGroup | None,
        lease: WriterLease | None,
        memory: MemoryTier | None,
        *,
        keep: int | None,
        async_save: bool,
        staging_dir: str | os.PathLike[str] | None,
        sync_files: bool,
    ) -> None:
        self.pg = pg
        #: Step of the last checkpoint completed and published (or restored).
        self.last_saved_step: int | None = None
        #: MLflow run id of the last save (or of the checkpoint restored).
        self.mlflow_run_id: str | None = None
        #: A due save waits for the lease's verdict: ``maybe_save`` saves at the next step.
        self.deferred = False
        self._root = root
        self._target = root.target
        self._lease = lease
        self._memory = memory
        self._staging_dir = staging_dir
        self._sync_files = sync_files
        self._lock = threading.Lock()
        self._future: Future[Any] | None = None
        self._future_step: int | None = None
        self._future_timing: SaveTiming | None = None
        self._published_step: int | None = None
        self._last_seen: tuple[int, dict[str, Any], dict[str, Any] | None] | None = None
        # The step being saved: retention never deletes it, even when it is older than the
        # newest checkpoint. A one-element list so the retention thread holds no saver.
        saving: list[int | None] = [None]
        self._saving = saving
        self._stager = ReusableStager() if async_save else None
        self._retention = (
            RetentionWorker(self._target, keep, lambda: [s for s in saving if s is not None])
            if keep and runtime.get_rank() == 0
            else None
        )

    @property
    def future(self) -> Future[Any] | None:
        """The background save in flight, until :meth:`wait` collects it."""
        with self._lock:
            return self._future

    def remember(self, step: int, objs: dict[str, Any], extra: dict[str, Any] | None) -> None:
        """Note the last step seen by ``maybe_save``: ``close`` saves it if nothing later does."""
        self._last_seen = (step, dict(objs), extra)

    def raise_failed(self) -> None:
        """Raise the error of a background save that already failed (else nothing)."""
        future = self.future
        if future is not None and future.done() and future.exception() is not None:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is published and the memory snapshot being
        written (if any) is complete; raise the save's error if it failed."""
        if self._memory is not None:
            self._memory.wait()
        with self._lock:
            future, step = self._future, self._future_step
            self._future = None
        if future is None or step is None:
            return
        try:
            future.result()
        except BaseException as exc:
            if not future.done():  # interrupted while waiting: the save goes on
                with self._lock:
                    if self._future is None:
                        self._future = future
                raise
            self._discard(step)
            raise unwrap(exc, f"background save of step {step}") from None
        self._published(step, self._future_timing)

    def close(self) -> None:
        """Stop retention and free the staging buffers (after :meth:`wait`)."""
        self._last_seen = None
        if self._retention is not None:
            self._retention.close()
        if self._stager is not None:
            self._stager.close()

    def save(self, step: int, extra: dict[str, Any] | None, objs: dict[str, Any]) -> bool:
        """Save ``objs`` as ``step`` (after the save in flight); False while it is deferred."""
        check_extra(extra)
        self._root.result()
        self.wait()
        kinds = _objects.classify(objs)
        name = step_dir_name(step)
        verdict: SaveVerdict = agree(
            self.pg,
            save_verdict(self._target, self._lease, self._target.url, name, is_foreign)
            if runtime.get_rank() == 0
            else None,
        )
        if verdict.case is SaveCase.DEFER:
            if not self.deferred:
                _log.warning("not saving step %d yet: %s", step, verdict.error)
            self.deferred = True
            self.remember(step, objs, extra)
            return False
        self.deferred = False
        if verdict.case is SaveCase.REFUSE:
            assert verdict.error is not None
            raise verdict.error
        if verdict.case is SaveCase.REPLACE:  # a resumed loop saving its restored step again
            _log.info(
                "replacing checkpoint %s/%s (atomically: old or new, never a mix)",
                self._target.url,
                name,
            )
        if self._memory is not None:
            self._memory.note_volume_save(step)  # before the save can complete
        # The run this training logs to: the active one, else the one last saved or
        # restored (a logger closed before the final save on close still owns the run).
        self.mlflow_run_id = active_mlflow_run_id() or self.mlflow_run_id
        state = _state.build_state(
            step,
            kinds,
            runtime.get_rank(),
            runtime.get_world_size(),
            extra or {},
            self.mlflow_run_id,
        )
        writer = VolumeWriter(
            self._target.child(name), staging_dir=self._staging_dir, sync_files=self._sync_files
        )
        if self.pg is None:
            quiet_single_process_warning()
        self._saving[0] = step
        started = time.perf_counter()
        try:
            if self._stager is None:
                dcp.save(state, storage_writer=writer, process_group=self.pg)
            else:
                result = dcp.async_save(
                    state, storage_writer=writer, async_stager=self._stager, process_group=self.pg
                )
                # DCP answers with an AsyncSaveResponse only for a stager that stages in
                # the background, which the reusable one does not: its upload is the save.
                upload: Any = getattr(result, "upload_completion", result)
                future: Future[Any] = upload
        except BaseException as exc:  # noqa: BLE001 - re-raised as the error unwrap makes of it
            self._discard(step)
            raise unwrap(exc, f"saving step {step}") from None
        timing = SaveTiming.now(started, writer)
        if self._stager is None:
            self._published(step, timing)
        else:
            track(future)  # a fork (loader workers) waits for it; see _forks
            with self._lock:
                self._future, self._future_step = future, step
                self._future_timing = timing

            def published(done: Future[Any], s: int = step, t: SaveTiming = timing) -> None:
                if done.exception() is None:
                    self._published(s, t)

            future.add_done_callback(published)
        return True

    def _discard(self, step: int) -> None:
        """Remove what a failed save of ``step`` left (never a published checkpoint)."""
        self._saving[0] = None
        if runtime.get_rank() != 0:
            return
        name = step_dir_name(step)
        try:
            if not is_foreign(self._target, name) and not self._target.exists(
                f"{name}/{METADATA_NAME}"
            ):
                self._target.remove_tree(name)
        except OSError as exc:
            _log.warning("could not remove %s/%s of a failed save: %s", self._target.url, name, exc)

    def _published(self, step: int, timing: SaveTiming | None = None) -> None:
        # Called from the save's done-callback and from wait(), whichever comes first.
        with self._lock:
            if self._published_step == step:
                return
            self._published_step = step
            self.last_saved_step = step
            if self._saving[0] == step:
                self._saving[0] = None
        if runtime.get_rank() == 0:
            _report.saved(self._target.child(step_dir_name(step)).url, step, timing)
        # A manager that lost the root to another writer deletes nothing of theirs.
        if self._retention is not None and (self._lease is None or self._lease.held):
            self._retention.request()

    def save_last_seen(self) -> None:
        """The final save of ``close``: the last step seen by ``maybe_save``, if newer."""
        seen = self._last_seen
        step, steps = final_step(self.pg, seen[0] if seen else None, self.last_saved_step)
        if step is None or seen is None:
            if len(set(steps)) != 1:
                _log.warning("ranks reached different last steps %s; no final save on close", steps)
            return
        _log.info("saving step %d, the last one reached, on close", step)
        if self._lease is not None:
            self._lease.settle()  # a watch of the lease in progress: close may wait for it
        self.save(step, seen[2], seen[1])
        self.wait()
