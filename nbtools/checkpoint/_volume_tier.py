"""Choosing the checkpoint ``restore`` loads: the newest one whose data verifies.

Rank 0 walks the complete checkpoints newest first; every rank tries to load
the one rank 0 names. When the data of any rank does not match its recorded
checksums (a flipped bit on the volume, a damaged upload), all ranks skip it
together, with a warning that names it and says why (and a
``checkpoint_skipped`` event), and try the next older one. A checkpoint deleted
while it is read (the retention of a run saving into the root, with a small
``keep``) is no fault either: the ranks look again and load the newest one,
which is newer. Any other failure (objects that do not match the checkpoint, a
saved value of a type ``weights_only`` refuses) is raised: it would fail on the
older ones too. :func:`restore_newest` puts the chosen one back into the objects.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp

from nbtools import events, runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import agree, gather
from nbtools.checkpoint._dcp import quiet_single_process_warning, unwrap
from nbtools.checkpoint._storage import METADATA_NAME, Target, step_dir_name
from nbtools.checkpoint.discovery import candidates
from nbtools.checkpoint.reader import VolumeReader
from nbtools.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Restored", "newest_verified", "restore_newest"]

_log = get_logger("checkpoint")

#: Checkpoints one restore may lose to retention before it gives up.
MAX_LOST = 50

Loaded = tuple[dict[str, Any], dict[str, Any]]


@dataclass
class Restored:
    """What a restore loaded.

    Attributes:
        directory: The checkpoint loaded; None when the root holds none.
        step: Its step; None when the root holds none.
        state: The model and optimizer state loaded (as DCP filled it in).
        blob: This rank's per-rank state (RNG streams, stateful objects,
            ``extra``, ``mlflow_run_id``).
        skipped: ``(url, reason)`` of each newer checkpoint passed over because
            its data did not verify.
    """

    directory: Target | None = None
    step: int | None = None
    state: dict[str, Any] = field(default_factory=dict)
    blob: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class _Choice:
    """Rank 0's word to every rank: the step to try next, or the error that ends the search
    (neither: no checkpoint is left)."""

    step: int | None = None
    error: BaseException | None = None


def _lost(directory: Target) -> bool:
    """Whether ``directory`` lost its ``.metadata`` (retention deletes it first)."""
    try:
        return not directory.exists(METADATA_NAME)
    except OSError:
        return False


def _kind(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    if isinstance(error, CorruptCheckpointError) and not isinstance(error, UnsafeCheckpointError):
        return "corrupt"
    return "error"


def newest_verified(
    target: Target,
    load: Callable[[Target, Any], Loaded],
    pg: Any,
) -> Restored:
    """Load the newest checkpoint under ``target`` that verifies on every rank.

    Rank 0 chooses; the ranks agree on the step only and each opens that step's
    directory under its own ``target``.

    Args:
        target: The checkpoint root.
        load: ``load(directory, metadata_or_None)`` loads one checkpoint on this
            rank, returning ``(state, per_rank_blob)``; a collective.
        pg: The process group of the ranks (None: one process).

    Returns:
        The checkpoint loaded, and those passed over (see :class:`Restored`).

    Raises:
        CorruptCheckpointError: Checkpoints exist but none verifies.
    """
    found = candidates(target) if runtime.get_rank() == 0 else None
    skipped: list[tuple[str, str]] = []
    passed: set[int] = set()  # steps skipped as corrupt
    lost = 0
    while True:
        verdict, metadata = _Choice(), None
        if found is not None:
            try:
                item = next(found, None)
                if item is not None:
                    verdict, metadata = _Choice(step=item[0]), item[2]
            except Exception as exc:  # noqa: BLE001 - every rank must raise it, not hang
                verdict = _Choice(error=exc)
        choice: _Choice = agree(pg, verdict)
        if choice.error is not None:
            raise choice.error
        if choice.step is None:
            if skipped:
                listed = "; ".join(f"{url}: {reason}" for url, reason in skipped)
                raise CorruptCheckpointError(
                    f"no checkpoint under {target.url} verifies ({listed}). The objects passed to "
                    "restore may hold values loaded in part: recreate them before starting "
                    "afresh, or move the damaged checkpoints away"
                )
            return Restored(skipped=skipped)
        step = choice.step
        directory = target.child(step_dir_name(step))
        url = directory.url
        state: dict[str, Any] = {}
        blob: dict[str, Any] = {}
        try:
            state, blob = load(directory, metadata)
            error = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException
            error = unwrap(exc, f"restoring {url}")
        outcomes = gather(pg, (_kind(error), str(error) if error is not None else ""))
        if all(kind == "ok" for kind, _ in outcomes):
            return Restored(directory, step, state, blob, skipped)
        if agree(pg, _lost(directory) if runtime.get_rank() == 0 else None):
            lost += 1
            if lost > MAX_LOST:
                raise CheckpointError(
                    f"{lost} checkpoints under {target.url} were deleted while this restore "
                    "read them (the retention of a run saving there): keep more of them "
                    "(keep=2 or more), or restore from a copy"
                )
            _log.info("%s was deleted while it was read; loading the newest one", url)
            found = candidates(target, skip=passed) if runtime.get_rank() == 0 else None
            continue
        if any(kind == "error" for kind, _ in outcomes):
            if error is not None:
                raise error
            ranks = [r for r, (kind, _) in enumerate(outcomes) if kind != "ok"]
            raise CheckpointError(f"restoring {url} failed on rank(s) {ranks}; see their errors")
        reason = next(message for kind, message in outcomes if kind == "corrupt")
        _log.warning("skipping checkpoint %s: %s; trying the previous one", url, reason)
        if runtime.get_rank() == 0:
            events.emit("checkpoint_skipped", message=f"skipped {url}: {reason}", step=step)
        skipped.append((url, reason))
        passed.add(step)


def _load(
    kinds: _state.Objects,
    directory: Target,
    metadata: Any,
    pg: Any,
    staging_dir: str | os.PathLike[str] | None,
    planner: Any = None,
) -> Loaded:
    """Load one checkpoint on this rank: its per-rank blob, then model and optimizer state."""

    def reader() -> VolumeReader:
        return VolumeReader(directory, staging_dir=staging_dir, process_group=pg)

    if metadata is None:
        metadata = reader().read_metadata()
    blob_state = _state.blob_template(metadata, runtime.get_rank())
    dcp.load(blob_state, storage_reader=reader(), process_group=pg)
    blob = _state.decode_blob(blob_state, kinds, directory.url)
    state = _state.load_template(kinds, metadata, directory.url)
    if state:
        dcp.load(state, storage_reader=reader(), process_group=pg, planner=planner)
    return state, blob


def restore_newest(
    target: Target,
    objs: dict[str, Any],
    pg: Any,
    staging_dir: str | os.PathLike[str] | None,
    planner: Any = None,
) -> Restored:
    """``CheckpointManager.restore``: load the newest verified checkpoint into ``objs``.

    Reads through :class:`VolumeReader` (staging in ``staging_dir``; model and
    optimizer state through ``planner``, DCP's default when None), puts
    everything back into ``objs`` and reports the restore (log and
    ``checkpoint_restored`` event).

    Returns:
        What was restored (:class:`Restored`; its ``step`` is None when the root
        holds no checkpoint).
    """
    started = time.perf_counter()
    kinds = _state.classify(objs)
    if pg is None:
        quiet_single_process_warning()
    restored = newest_verified(
        target,
        lambda directory, metadata: _load(kinds, directory, metadata, pg, staging_dir, planner),
        pg,
    )
    directory, step = restored.directory, restored.step
    if directory is None or step is None:
        return restored
    _state.apply_state(kinds, restored.state, restored.blob)
    _log.info("restored %s; resuming at step %d", directory.url, step + 1)
    if runtime.get_rank() == 0:
        events.emit(
            "checkpoint_restored",
            message=f"restored {directory.url}",
            step=step,
            seconds=round(time.perf_counter() - started, 4),
            tier="volume",
        )
    return restored
