"""The volume tier: the checkpoints under the root, the newest one whose data verifies.

:class:`VolumeTier` is the last of the tiers a restore asks (see ``_restore``):
it always answers. Its saves are the manager's :class:`~nbtools.checkpoint._saver.Saver`
(lease, publishing, retention), which it hands a snapshot to.

Rank 0 walks the complete checkpoints newest first; every rank tries to load
the one rank 0 names. When the data of any rank does not match its recorded
checksums (a flipped bit on the volume, a damaged upload), all ranks skip it
together, with a warning that names it and says why (and a
``checkpoint_skipped`` event), and try the next older one. A checkpoint deleted
while it is read (the retention of a run saving into the root, with a small
``keep``) is no fault either: the ranks look again and load the newest one,
which is newer. Any other failure (objects that do not match the checkpoint, a
saved value of a type ``weights_only`` refuses) is raised: it would fail on the
older ones too. :meth:`VolumeTier.load` puts the chosen one back into the objects.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nbtools import events, runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _objects, _state
from nbtools.checkpoint._collective import agree, gather
from nbtools.checkpoint._dcp import quiet_single_process_warning, unwrap
from nbtools.checkpoint._restore import Newest, Offer, Restored
from nbtools.checkpoint._saver import Saver
from nbtools.checkpoint._storage import METADATA_NAME, Target, step_dir_name
from nbtools.checkpoint.discovery import RootCheck, candidates, list_steps
from nbtools.checkpoint.reader import VolumeReader
from nbtools.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Found", "Probed", "VolumeStep", "VolumeTier", "newest_verified", "volume_newest"]

_log = get_logger("checkpoint")

#: Checkpoints one restore may lose to retention before it gives up.
MAX_LOST = 50

Loaded = tuple[dict[str, Any], dict[str, Any]]


@dataclass
class Found:
    """The checkpoint :func:`newest_verified` loaded.

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
) -> Found:
    """Load the newest checkpoint under ``target`` that verifies on every rank.

    Rank 0 chooses; the ranks agree on the step only and each opens that step's
    directory under its own ``target``.

    Args:
        target: The checkpoint root.
        load: ``load(directory, metadata_or_None)`` loads one checkpoint on this
            rank, returning ``(state, per_rank_blob)``; a collective.
        pg: The process group of the ranks (None: one process).

    Returns:
        The checkpoint loaded, and those passed over (see :class:`Found`).

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
            return Found(skipped=skipped)
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
            return Found(directory, step, state, blob, skipped)
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
    kinds: _objects.Objects,
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


def volume_newest(target: Target) -> int | None:
    """The newest complete checkpoint's step under ``target`` (rank 0 only reads it)."""
    return next((step for step, complete in list_steps(target) if complete), None)


class VolumeStep:
    """The volume's newest complete step, looked up by rank 0 in the background
    (``target()`` gives the volume's target): the volume tier's :class:`~nbtools.checkpoint._restore.Newest`.

    Listing a bucket takes round trips (and, in a fresh process, the client's
    start): :meth:`start` begins it, to overlap with reading the memory snapshot.
    Calling the object is a collective that gives every rank rank 0's answer
    (starting the lookup if needed); rank 0's error is raised on every rank. Use
    it as a context manager: leaving joins a lookup in progress.
    """

    def __init__(self, pg: dist.ProcessGroup | None, target: Callable[[], Target]) -> None:
        self._pg = pg
        self._target = target
        self._value: int | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin the lookup on rank 0 (once)."""
        if self._thread is None and runtime.get_rank() == 0:
            self._thread = threading.Thread(
                target=self._look, args=(self._target,), name="nbtools-volume-step", daemon=True
            )
            self._thread.start()

    def _look(self, target: Callable[[], Target]) -> None:
        try:
            self._value = volume_newest(target())
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by __call__
            self._error = exc

    def __enter__(self) -> VolumeStep:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._thread.join()

    def __call__(self) -> int | None:
        self.start()
        if self._thread is not None:
            self._thread.join()
        error = f"{type(self._error).__name__}: {self._error}" if self._error else ""
        value, error = agree(self._pg, (self._value, error))
        if self._error is not None:
            raise self._error
        if error:
            raise CheckpointError(f"rank 0 could not list the checkpoints on the volume: {error}")
        return value


class Probed(Protocol):
    """A writer lease, as the volume tier uses it: read before the volume is."""

    def probe(self) -> None: ...


class VolumeTier:
    """The checkpoints under the root, as a :class:`~nbtools.checkpoint._restore.Tier`.

    Args:
        root: The root's check (its ``result()`` is the target, once an object
            store's root is checked).
        saver: The manager's volume saves.
        staging_dir: Where reads stage (see :class:`VolumeReader`).
        lease: The manager's writer lease (rank 0's), read before the volume is.
    """

    name = "volume"

    def __init__(
        self,
        root: RootCheck,
        saver: Saver,
        staging_dir: str | os.PathLike[str] | None,
        lease: Probed | None = None,
    ) -> None:
        self._root = root
        self._saver = saver
        self._staging_dir = staging_dir
        self._lease = lease

    def offers(self, pg: dist.ProcessGroup | None, below: Newest) -> Offer | None:
        """The newest checkpoint that verifies, found as it loads (the last tier: always)."""
        if self._lease is not None:
            self._lease.probe()
        self._root.result()
        return Offer(self.name, None)

    def load(
        self,
        pg: dist.ProcessGroup | None,
        offer: Offer,
        kinds: _objects.Objects,
        planner: Any,
    ) -> Restored:
        """Load the newest verified checkpoint into the objects (read through
        :class:`VolumeReader`, staging in ``staging_dir``; model and optimizer state
        through ``planner``, DCP's default when None). Its ``step`` is None when the
        root holds none."""
        if pg is None:
            quiet_single_process_warning()
        target, staging_dir = self._root.result(), self._staging_dir

        def load(directory: Target, metadata: Any) -> Loaded:
            return _load(kinds, directory, metadata, pg, staging_dir, planner)

        found = newest_verified(target, load, pg)
        directory, step = found.directory, found.step
        if directory is None or step is None:
            return Restored(skipped=found.skipped)
        _state.apply_state(kinds, found.state, found.blob)
        _log.info("restored %s; resuming at step %d", directory.url, step + 1)
        return Restored(
            step,
            self.name,
            found.blob,
            found.skipped,
            found.blob.get("mlflow_run_id"),
            saved_step=step,
            where=directory.url,
        )

    def newest(self, pg: dist.ProcessGroup | None) -> VolumeStep:
        """The newest complete step on the volume, listed by rank 0 (see :class:`VolumeStep`)."""
        return VolumeStep(pg, self._root.result)

    def note_volume(self, step: int | None) -> None:
        """Nothing to note: the volume is the record."""

    def snapshot(
        self, step: int, objs: dict[str, Any], extra: dict[str, Any] | None, run_id: str | None
    ) -> bool:
        """Save ``objs`` as the checkpoint of ``step`` through the manager's :class:`Saver`
        (which records the MLflow run itself)."""
        return self._saver.save(step, extra, objs)

    def close(self, keep: bool) -> None:
        """Finish with the saves (the checkpoints stay: they are the volume's)."""
        self._saver.close()
