"""``MemoryTier``: the manager's snapshots in node-local memory, and restoring from them.

Every ``memory_every`` steps the manager hands the tier the same state a volume
checkpoint holds (:func:`nbtools.checkpoint._state.build_state`). Training is
blocked only while the tier copies that state into host buffers allocated once
and reused (the async save's :class:`~nbtools.checkpoint._host_buffers.ReusableStager`);
a background thread then writes the copy, with ``torch.save``, into a slot of
this rank (see ``_slots``). One write is in flight at a time: the next snapshot,
a restore and ``close`` wait for it first. Before the first snapshot the tier
checks that two slots per rank of this node fit in the snapshot filesystem, and
that they and the staging copies fit in the node's available memory; when they
do not, or a snapshot fails, it warns once and stops snapshotting (volume
checkpoints go on).

A restore asks every rank for the steps it holds; the newest step all ranks
hold is loaded from memory when it is at least as new as the volume's newest
checkpoint, and only when every rank read and checked its slot; otherwise the
volume is used as before.

The snapshots of a job outlive its ranks (a restarted rank finds them) and
end with it: a manager closed without an error removes its rank's slots;
directories whose keeper process (the ranks' launching process) is gone are
swept when a manager starts.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nbtools import events, runtime
from nbtools._internal.holder import Holder, machine_id, process_started
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import agree, gather
from nbtools.checkpoint._host_buffers import ReusableStager
from nbtools.checkpoint._memory import _slots
from nbtools.errors import CheckpointError

__all__ = ["MemoryTier", "memory_restore", "agreed_volume_step", "report"]

_log = get_logger("checkpoint")

#: Fraction of the node's available memory the snapshots of its ranks may take.
_MEMORY_SHARE = 0.5


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    return 64


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _job() -> tuple[str, Holder]:
    """This job's key and keeper: the launch's run id and the ranks' launching process,
    or, for a process started by hand, the process itself."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        parent = os.getppid()
        return f"run:{run}", Holder(machine_id(), parent, process_started(parent))
    me = Holder.me()
    return f"process:{me.machine}:{me.pid}:{me.started}", me


class MemoryTier:
    """The snapshots of one manager's rank.

    Args:
        every: Snapshot when ``step % every == 0``.
        root: The checkpoint root's URL (snapshots of another root are another job's).
    """

    def __init__(self, every: int, root: str) -> None:
        self.every = every
        self.rank = runtime.get_rank()
        self.world = runtime.get_world_size()
        run, keeper = _job()
        self.key = f"{run}|{root}|world={self.world}"
        self.enabled = True
        self._checked = False
        self._stager = ReusableStager()
        self._writer: threading.Thread | None = None
        self._error: str | None = None  # what the last background write failed with
        self.user = _slots.user_dir()
        _slots.sweep(self.user, own=_slots.job_path(self.user, self.key))
        self.directory = _slots.job_dir(self.user, self.key, keeper)
        _slots.sweep_temporaries(self.directory, self.rank)

    def due(self, step: int) -> bool:
        """Whether ``maybe_save(step)`` snapshots."""
        return self.enabled and step % self.every == 0

    def _off(self, why: str) -> None:
        self.enabled = False
        _log.warning("memory snapshots are off for this run: %s; volume checkpoints go on", why)

    def _fits(self, state: dict[str, Any]) -> bool:
        size = _tensor_bytes(state) + _slots.HEADER_BYTES
        ranks = max(1, runtime.get_local_world_size())
        need = 2 * ranks * size
        free = shutil.disk_usage(self.directory).free
        memory = _available_memory()
        held = sum(s.size for s in self._own())
        # The slots live in memory too (tmpfs), next to each rank's staging copy.
        in_memory = need + ranks * size
        if need > free + held or (memory is not None and in_memory > _MEMORY_SHARE * memory + held):
            self._off(
                f"two snapshots for each of the {ranks} rank(s) of this node need about "
                f"{need / 2**20:.1f} MiB ({size / 2**20:.1f} MiB each) in {self.user}, and "
                f"{in_memory / 2**20:.1f} MiB of memory with their staging copies, but that "
                f"filesystem has {free / 2**20:.1f} MiB free"
                + (f" and the node {memory / 2**20:.1f} MiB of memory available" if memory else "")
                + ". Give the shared-memory mount more room (docker run --shm-size=...), point "
                "NBTOOLS_SNAPSHOT_DIR at a larger tmpfs, or snapshot less state"
            )
            return False
        return True

    def _own(self) -> list[_slots.Slot]:
        return sorted(
            _slots.slots(self.directory, self.key, self.rank, self.world), key=lambda s: s.step
        )

    def snapshot(self, step: int, state: dict[str, Any]) -> bool:
        """Copy ``state`` and write the copy in the background as this rank's snapshot of
        ``step``; whether a write was started (see :meth:`wait`)."""
        if not self.enabled:
            return False
        self.wait()
        if not self.enabled:  # the previous write failed
            return False
        if not self._checked:
            self._checked = True
            if not self._fits(state):
                return False
        try:
            staged = self._stager.stage(state)
        except Exception as exc:  # noqa: BLE001 - a snapshot that fails never stops training
            self._off(f"the state of step {step} could not be copied for its snapshot ({exc})")
            return False
        # The thread ends with its write; wait() joins it. Not a daemon: a process that
        # exits lets the write finish, so it never leaves a temporary file behind.
        self._writer = threading.Thread(
            target=self._write, args=(step, staged), name=f"nbtools-snapshot-{self.rank}"
        )
        self._writer.start()
        return True

    def _write(self, step: int, staged: dict[str, Any]) -> None:
        try:
            # Keep the newest complete slot while the new one is written: at most two.
            # The file of the one that goes is reused for the new one.
            own = self._own()
            older = [s for s in own if s.step != step][-1:]
            drop = [s for s in own if s not in older]
            reuse = drop.pop(0) if drop else None
            _slots.remove([s.path for s in drop])
            _slots.write_slot(
                self.directory,
                self.key,
                self.rank,
                self.world,
                step,
                lambda fh: torch.save(staged, fh),
                reuse=reuse,
            )
        except Exception as exc:  # noqa: BLE001 - reported by wait(), on the training thread
            self._error = (
                f"the snapshot of step {step} could not be written to {self.directory} ({exc})"
            )

    def wait(self) -> None:
        """Block until the snapshot being written (if any) is complete; a write that failed
        turns the tier off with one warning."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        if self._error is not None:
            error, self._error = self._error, None
            self._off(error)

    def steps(self) -> list[int]:
        """Steps this rank holds a snapshot of, newest first."""
        self.wait()
        return sorted({s.step for s in self._own()}, reverse=True)

    def load(self, step: int) -> dict[str, Any]:
        """The state this rank snapshotted at ``step``, read and checked."""
        for slot in self._own():
            if slot.step == step:
                data = _slots.read_slot(slot)
                return torch.load(io.BytesIO(data), weights_only=True)
        raise CheckpointError(
            f"rank {self.rank} holds no snapshot of step {step} in {self.directory}"
        )

    def close(self, keep: bool) -> None:
        """Remove this rank's snapshots unless ``keep`` (a close after an error keeps them)."""
        self.wait()
        self._stager.close()
        if keep:
            return
        _slots.remove([s.path for s in self._own()])
        _slots.sweep_temporaries(self.directory, self.rank)
        _slots.drop_job_if_empty(self.directory)


def _check_fits(kinds: _state.Objects, state: dict[str, Any], where: str) -> None:
    for name, model in kinds.models.items():
        if set(state.get(name) or {}) != set(get_model_state_dict(model)):
            raise CheckpointError(f"{where} holds other parameters for {name!r}")
    for name in kinds.optimizers:
        if name not in state:
            raise CheckpointError(f"{where} holds no optimizer {name!r}")


def memory_restore(
    tier: MemoryTier, kinds: _state.Objects, pg: Any, volume_step: int | None
) -> tuple[int, dict[str, Any]] | None:
    """Restore from memory when every rank holds a step at least as new as the volume's.

    A collective. Returns ``(step, blob)`` once the objects hold the snapshot, or
    None (nothing changed) when the volume must be used.
    """
    held = gather(pg, tier.steps())
    common = set(held[0]).intersection(*map(set, held[1:])) if held else set()
    step = max(common, default=None)
    if step is None or (volume_step is not None and step < volume_step):
        return None
    where = f"the memory snapshot of step {step} on rank {tier.rank}"
    state: dict[str, Any] = {}
    blob: dict[str, Any] = {}
    error = ""
    try:
        state = tier.load(step)
        _check_fits(kinds, state, where)
        blob = _state.decode_blob({_state.NS: state[_state.NS]}, kinds, where)
    except Exception as exc:  # noqa: BLE001 - every rank must learn it, then use the volume
        error = f"{type(exc).__name__}: {exc}"
    errors = gather(pg, error)
    if any(errors):
        first = next(e for e in errors if e)
        _log.warning("not restoring step %d from memory (%s); using the volume", step, first)
        return None
    _state.apply_state(kinds, state, blob)
    _log.info("restored step %d from memory; resuming at step %d", step, step + 1)
    return step, blob


def volume_newest(target: Any) -> int | None:
    """The newest complete checkpoint's step under ``target`` (rank 0 only reads it)."""
    from nbtools.checkpoint.discovery import list_steps

    return next((step for step, complete in list_steps(target) if complete), None)


def agreed_volume_step(pg: Any, target: Any) -> int | None:
    """:func:`volume_newest`, read by rank 0 and known to every rank."""
    return agree(pg, volume_newest(target) if runtime.get_rank() == 0 else None)


def report(step: int, seconds: float) -> None:
    """The ``checkpoint_restored`` event of a restore from memory (rank 0)."""
    if runtime.get_rank() == 0:
        events.emit(
            "checkpoint_restored",
            message=f"restored step {step} from memory",
            step=step,
            seconds=round(seconds, 4),
            tier="memory",
        )
