"""The save half of :class:`~nbtools.checkpoint.CheckpointManager`: one volume save, start to publish.

``_save`` agrees with every rank on what the save may do (go ahead, wait for
the root's writer lease, refuse, or atomically replace a checkpoint of the same
step), builds the state, and writes it through a :class:`VolumeWriter`, in the
background with ``dcp.async_save`` unless ``async_save=False``; the step is
published (``last_saved_step``, the ``checkpoint_saved`` report, retention)
when the write completes. ``_save_last_seen`` is the final save of ``close``.
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
from nbtools.checkpoint import _report, _state
from nbtools.checkpoint._checks import SaveCase, SaveVerdict, check_extra, save_verdict
from nbtools.checkpoint._collective import agree, final_step
from nbtools.checkpoint._errors import unwrap
from nbtools.checkpoint._forks import track
from nbtools.checkpoint._host_buffers import ReusableStager
from nbtools.checkpoint._lease import WriterLease
from nbtools.checkpoint._memory._tier import MemoryTier
from nbtools.checkpoint._quiet import quiet_single_process_warning
from nbtools.checkpoint._report import SaveTiming
from nbtools.checkpoint._retention import RetentionWorker
from nbtools.checkpoint._storage._layout import METADATA_NAME, step_dir_name
from nbtools.checkpoint._storage._target import Target
from nbtools.checkpoint.discovery import RootCheck, is_foreign
from nbtools.checkpoint.writer import VolumeWriter

__all__ = ["SavingHalf"]

_log = get_logger("checkpoint")


class SavingHalf:
    """The volume-save methods the manager inherits; the manager's ``__init__`` sets the state."""

    root: str
    mlflow_run_id: str | None
    last_saved_step: int | None
    _root: RootCheck
    _target: Target
    _pg: dist.ProcessGroup | None
    _lease: WriterLease | None
    _memory: MemoryTier | None
    _retention: RetentionWorker | None
    _stager: ReusableStager | None
    _staging_dir: str | os.PathLike[str] | None
    _sync_files: bool
    _deferred: bool
    _last_seen: tuple[int, dict[str, Any], dict[str, Any] | None] | None
    _saving: list[int | None]
    _lock: threading.Lock
    _future: Future | None
    _future_step: int | None
    _future_timing: SaveTiming | None
    _published_step: int | None

    def wait(self) -> None:  # the manager's
        raise NotImplementedError

    def _save(self, step: int, extra: dict[str, Any] | None, objs: dict[str, Any]) -> bool:
        check_extra(extra)
        self._root.result()
        self.wait()
        kinds = _state.classify(objs)
        name = step_dir_name(step)
        verdict: SaveVerdict = agree(
            self._pg,
            save_verdict(self._target, self._lease, self.root, name, is_foreign)
            if runtime.get_rank() == 0
            else None,
        )
        if verdict.case is SaveCase.DEFER:
            if not self._deferred:
                _log.warning("not saving step %d yet: %s", step, verdict.error)
            self._deferred = True
            self._last_seen = (step, dict(objs), extra)  # close() saves it if nothing later does
            return False
        self._deferred = False
        if verdict.case is SaveCase.REFUSE:
            assert verdict.error is not None
            raise verdict.error
        if verdict.case is SaveCase.REPLACE:  # a resumed loop saving its restored step again
            _log.info(
                "replacing checkpoint %s/%s (atomically: old or new, never a mix)", self.root, name
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
        if self._pg is None:
            quiet_single_process_warning()
        self._saving[0] = step
        started = time.perf_counter()
        try:
            if self._stager is None:
                dcp.save(state, storage_writer=writer, process_group=self._pg)
            else:
                result = dcp.async_save(
                    state, storage_writer=writer, async_stager=self._stager, process_group=self._pg
                )
                # DCP answers with an AsyncSaveResponse only for a stager that stages in
                # the background, which the reusable one does not: its upload is the save.
                upload: Any = getattr(result, "upload_completion", result)
                future: Future[Any] = upload
        except BaseException as exc:
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
            _log.warning("could not remove %s/%s of a failed save: %s", self.root, name, exc)

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

    def _save_last_seen(self) -> None:
        """The final save of ``close``: the last step seen by ``maybe_save``, if newer."""
        seen = self._last_seen
        step, steps = final_step(self._pg, seen[0] if seen else None, self.last_saved_step)
        if step is None or seen is None:
            if len(set(steps)) != 1:
                _log.warning("ranks reached different last steps %s; no final save on close", steps)
            return
        _log.info("saving step %d, the last one reached, on close", step)
        if self._lease is not None:
            self._lease.settle()  # a watch of the lease in progress: close may wait for it
        self._save(step, seen[2], seen[1])
        self.wait()
