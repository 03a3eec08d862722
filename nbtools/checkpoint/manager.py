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
import threading
import warnings
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nbtools import runtime
from nbtools._internal.log import get_logger
from nbtools._internal.runinfo import active_mlflow_run_id
from nbtools.checkpoint import _state
from nbtools.checkpoint._errors import unwrap
from nbtools.checkpoint._retention import RetentionWorker
from nbtools.checkpoint._stager import ReusableStager
from nbtools.checkpoint._target import LocalTarget
from nbtools.checkpoint.discovery import _latest, root_target, step_dir_name
from nbtools.checkpoint.reader import VolumeReader
from nbtools.checkpoint.writer import METADATA_NAME, VolumeWriter
from nbtools.errors import CheckpointError

__all__ = ["CheckpointManager"]

_log = get_logger("checkpoint")
# Without a process group DCP warns on every save and load that it assumes one process,
# which is exactly what a notebook without @distributed intends.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
)


def _positive(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (or None), got {value}")
    return value


def _check_writable(target: Any) -> None:
    if not isinstance(target, LocalTarget):
        return
    path = target.root
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint root {target.root} is not writable ({path} refuses writes)"
        )


class CheckpointManager:
    """Saves and restores training state under ``root/step_<N>/``.

    Args:
        root: Directory (local, NFS, FUSE) or fsspec URL holding the checkpoints.
        every: ``maybe_save`` saves when ``step % every == 0``; None: only ``save`` saves.
        keep: Complete checkpoints to keep (older ones are deleted in the
            background); None keeps all.
        async_save: Save in the background with ``dcp.async_save`` (the caller is
            blocked only while the state is copied into reused staging buffers).
        staging_dir: Local staging directory (default ``NBTOOLS_STAGING_DIR`` or temp dir).
        sync_files: fsync shards before publishing ``.metadata``.

    Attributes:
        restored_step: Step of the checkpoint ``restore`` loaded, or None.
        last_saved_step: Step of the last checkpoint completed and published
            (by this manager, or the one restored).
        mlflow_run_id: MLflow run id recorded in the restored checkpoint, or None.
        extra: The ``extra`` dict recorded in the restored checkpoint.
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
    ) -> None:
        self.every = _positive("every", every)
        self.keep = _positive("keep", keep)
        self._target = root_target(root)
        _check_writable(self._target)
        self.root = self._target.url
        self.async_save = async_save
        self._staging_dir = staging_dir
        self._sync_files = sync_files
        self.restored_step: int | None = None
        self.last_saved_step: int | None = None
        self.mlflow_run_id: str | None = None
        self.extra: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._future: Future | None = None
        self._future_step: int | None = None
        self._published_step: int | None = None
        self._stager = ReusableStager() if async_save else None
        # Saves run collectives from a background thread: they get their own gloo group
        # so they never interleave with the training loop's collectives.
        self._pg = dist.new_group(backend="gloo") if runtime.is_distributed() else None
        self._retention = (
            RetentionWorker(self._target, self.keep)
            if self.keep and runtime.get_rank() == 0
            else None
        )
        self._closed = False

    # --- collective helpers -------------------------------------------------

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (ranks must take the same branch)."""
        if self._pg is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._pg, 0), group=self._pg)
        return box[0]

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one")

    # --- restore -------------------------------------------------------------

    def restore(self, **objs: Any) -> int:
        """Load the newest complete checkpoint into ``objs``; return the next step to run.

        Args:
            **objs: Models, optimizers and stateful objects by name, as given to ``save``.

        Returns:
            Saved step + 1, or 0 when there is no checkpoint.
        """
        self._check_open()
        self.wait()
        kinds = _state.classify(objs)
        found, verdict = None, None
        if runtime.get_rank() == 0:
            try:
                found = _latest(self._target)
                verdict = found[0] if found else None
            except Exception as exc:  # noqa: BLE001 - every rank must raise it, not hang
                verdict = exc
        url = self._agree(verdict)
        if isinstance(url, BaseException):
            raise url
        if url is None:
            self.restored_step = None
            return 0
        step = int(url.rstrip("/").rsplit("step_", 1)[1])
        child = self._target.child(step_dir_name(step))
        metadata = found[2] if found else VolumeReader(url).read_metadata()
        try:
            blob_state = _state.blob_template(metadata, runtime.get_rank())
            dcp.load(blob_state, storage_reader=self._reader(child.url), process_group=self._pg)
            blob = _state.decode_blob(blob_state, kinds, url)
            state = _state.load_template(kinds, metadata, url)
            if state:
                dcp.load(state, storage_reader=self._reader(child.url), process_group=self._pg)
        except BaseException as exc:
            raise unwrap(exc, f"restoring {url}") from None
        _state.apply_state(kinds, state, blob)
        self.restored_step = step
        self.last_saved_step = step
        self.extra = dict(blob.get("extra") or {})
        self.mlflow_run_id = blob.get("mlflow_run_id")
        _log.info("restored %s; resuming at step %d", url, step + 1)
        return step + 1

    def _reader(self, url: str) -> VolumeReader:
        return VolumeReader(url, staging_dir=self._staging_dir)

    # --- save ------------------------------------------------------------------

    def maybe_save(self, step: int, *, extra: dict[str, Any] | None = None, **objs: Any) -> bool:
        """Save when ``step % every == 0``; returns whether a save was started.

        Raises the error of a failed background save even when no save is due.
        """
        self._check_open()
        self._raise_failed()
        if self.every is None or step % self.every != 0:
            return False
        return self.save(step, extra=extra, **objs)

    def save(self, step: int, *, extra: dict[str, Any] | None = None, **objs: Any) -> bool:
        """Checkpoint ``objs`` as ``step`` (asynchronously unless ``async_save=False``).

        Waits for the previous save first (one save in flight). When this
        returns, the objects may be changed: the checkpoint holds their values
        at the moment of the call. Returns False when ``step`` already has a
        complete checkpoint under root (it is never overwritten).
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, not {type(extra).__name__}")
        self.wait()
        kinds = _state.classify(objs)
        name = step_dir_name(step)
        exists = self._target.exists(f"{name}/{METADATA_NAME}") if runtime.get_rank() == 0 else None
        if self._agree(exists):
            _log.warning("checkpoint %s/%s already exists; not overwriting it", self.root, name)
            return False
        state = _state.build_state(
            step,
            kinds,
            runtime.get_rank(),
            runtime.get_world_size(),
            extra or {},
            active_mlflow_run_id(),
        )
        writer = VolumeWriter(
            self._target.child(name).url, staging_dir=self._staging_dir, sync_files=self._sync_files
        )
        try:
            if self._stager is None:
                dcp.save(state, storage_writer=writer, process_group=self._pg)
            else:
                future = dcp.async_save(
                    state, storage_writer=writer, async_stager=self._stager, process_group=self._pg
                )
        except BaseException as exc:
            raise unwrap(exc, f"saving step {step}") from None
        if self._stager is None:
            self._published(step)
        else:
            with self._lock:
                self._future, self._future_step = future, step
            future.add_done_callback(lambda f, s=step: f.exception() is None and self._published(s))
        return True

    def _published(self, step: int) -> None:
        # Called from the save's done-callback and from wait(), whichever comes first.
        with self._lock:
            if self._published_step == step:
                return
            self._published_step = step
            self.last_saved_step = step
        if self._retention is not None:
            self._retention.request()

    def _raise_failed(self) -> None:
        with self._lock:
            future = self._future
        if future is not None and future.done() and future.exception() is not None:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise its error if it failed."""
        with self._lock:
            future, step = self._future, self._future_step
            self._future = None
        if future is None:
            return
        try:
            future.result()
        except BaseException as exc:
            raise unwrap(exc, f"background save of step {step}") from None
        self._published(step)

    def close(self) -> None:
        """Wait for the last save, finish pending deletions and release staging buffers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._retention is not None:
                self._retention.close()
            if self._stager is not None:
                self._stager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001 - keep the original error
            _log.warning("closing the checkpoint manager failed too: %s", close_exc)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, every={self.every}, keep={self.keep})"
