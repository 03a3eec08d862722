"""``MemoryTier``: the manager's snapshots in node-local memory, and their replicas on peers.

Every ``memory_every`` steps the manager hands the tier the same state a volume
checkpoint holds (:func:`nbtools.checkpoint._state.build_state`). The tier
copies that state's tensors once (the ranks of a node each a share of the
replicated ones, see ``_layout``), straight into this rank's next slot file in
shared memory (mapped, see ``_slots``; raw bytes, see ``_layout``): what a
forward pass may change at once, the parameters and optimizer state on a
background thread that the next optimizer step waits for (see ``_copy_behind``),
checksumming each chunk as it is copied. That thread then, at a lower priority,
publishes the slot and, with ``replicas``, sends it to the ranks that hold it
and stores the replicas this rank holds through its slots' sink (see ``_replicas``). One round is in
flight at a time: the next snapshot, a restore and ``close`` wait for it first.

Before the first snapshot the tier checks that two slots per rank of this node
(and two per replica it holds) fit in the snapshot filesystem and in the node's
available memory; the ranks exchanging replicas agree on it. When they do not
fit, or a snapshot fails, the tier warns once and stops snapshotting (volume
checkpoints go on); a rank that exchanges replicas keeps taking part in the
exchange, sending nothing, so its peers never wait for it.

The snapshots of a job outlive its ranks (a restarted rank finds them) and
end with it: a manager closed without an error removes its rank's slots and
the replicas it holds; directories whose keeper process (the ranks' launching
process) is gone are swept when a manager starts. A snapshot directory that
cannot be trusted never stops training (see ``_directories``): the tier falls back
to a private directory, or is off for the job, with one warning. Restoring is the
tier's offer (the choice of step, ``_choice``) and load (``_in_place``); the slot a
rank restores stays valid until a newer snapshot replaces it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nbtools import runtime
from nbtools._internal.holder import Holder, machine_id, process_started
from nbtools.checkpoint import _objects, _state
from nbtools.checkpoint._collective import gather
from nbtools.checkpoint._memory import (
    _choice,
    _directories,
    _in_place,
    _layout,
    _mappings,
    _notes,
    _replicas,
    _sharded,
    _slots,
)
from nbtools.checkpoint._memory._copy_behind import (
    Behind,
    Mirrors,
    StepGate,
    copy_and_checksum,
    late_tensors,
    stepped,
)
from nbtools.checkpoint._memory._in_place import Consumed
from nbtools.checkpoint._memory._mappings import Mapped, MappedFiles, Spare, file_key
from nbtools.checkpoint._memory._slots import tensor_of
from nbtools.checkpoint._restore import Known, Newest, Offer, Restored
from nbtools.errors import CheckpointError

__all__ = ["MemoryTier"]


#: How much nicer than training the background thread runs (checksums, replicas).
_NICE = 5


def _job() -> tuple[str, Holder]:
    """This job's key and keeper: the launch's run id and the ranks' launching process,
    or, for a process started by hand, the process itself."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        parent = os.getppid()
        return f"run:{run}", Holder(machine_id(), parent, process_started(parent))
    me = Holder.me()
    return f"process:{me.machine}:{me.pid}:{me.started}", me


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


class MemoryTier:
    """The snapshots of one manager's rank, and the replicas it holds for its peers: the
    fastest :class:`~nbtools.checkpoint._restore.Tier`.

    Args:
        every: Snapshot when ``step % every == 0``.
        root: The checkpoint root's URL (snapshots of another root are another job's).
        replicas: Peers that hold each rank's snapshot (see ``_replicas``); 0 for none.
    """

    name = "memory"

    def __init__(self, every: int, root: str, replicas: int = 0) -> None:
        self.every = every
        self.rank = runtime.get_rank()
        self.world = runtime.get_world_size()
        local = runtime.get_local_world_size()
        run, keeper = _job()
        self.key = f"{run}|{root}|world={self.world}"
        self.enabled = True
        self._checked = False
        self._writer: threading.Thread | None = None
        self._volume: tuple[bool, int | None] = (False, None)  # see note_volume
        self._error: str | None = None  # what the last background round failed with
        self._consumed: Consumed | None = None  # own slot the restored state lives in
        self._late = True  # copy parameters and optimizer state behind training
        self._gate: StepGate | None = None  # makes optimizer steps wait for that copy
        self._mirrors = Mirrors()  # pinned host mirrors of CUDA tensors (see _copy_behind)
        self._notice: str | None = None  # why copies behind training stopped
        self.send_to = _replicas.holders(self.rank, self.world, local, replicas)
        self.receive_from = _replicas.sources(self.rank, self.world, local, replicas)
        # Every rank makes the group (a collective): for replicas, for sharing (``_layout``)
        # and for a restore's transfers to ranks that cannot read a slot where they are.
        distributed = runtime.is_distributed() and self.world > 1
        self.group = _replicas.new_group() if distributed else None
        self.share: _layout.Share | None = None  # decided at the first snapshot
        self._groups: dict[int, tuple[int, int]] = {}  # rank -> (base, count) of its share
        self.exchanging = self.group is not None and bool(self.send_to or self.receive_from)
        if replicas and not self.send_to and self.world > 1:
            _notes.once(
                f"no-peer|{self.key}",
                "replicas=%d: no peer rank to hold a replica; none are kept",
                replicas,
            )
        self._files = MappedFiles(3)
        self._held_files = MappedFiles(3 * max(1, len(self.receive_from)))
        self._keeper = keeper
        #: Whether this job's snapshot directory can be trusted: if not, the tier is off.
        self.trusted = False
        self.user, self.directory = self._place(run)
        if self.trusted:
            _slots.sweep_temporaries(self.directory, self.rank)
        self._spare = Spare(self._files, self.directory, self.rank)

    def _place(self, run: str) -> tuple[str, str]:
        """This user's snapshot directory and this job's in it (swept of dead jobs first).

        A snapshot directory that cannot be trusted never stops training: when the
        usual one is another user's (or a link, or open to others) the snapshots go to
        a private directory with a name nobody else can predict; when the job's own
        directory cannot be trusted, the tier is off for the job (one warning) and
        restores and checkpoints use the volume.
        """
        try:
            user = _directories.user_dir()
        except (CheckpointError, OSError) as exc:
            secret = run if run.startswith("run:") else None
            try:
                user = _directories.private_dir(secret)
            except (CheckpointError, OSError) as again:
                self._off(f"{exc}; and {again}")
                return "", ""
            _notes.once(
                f"fallback|{user}",
                "%s; this job's snapshots go to the private directory %s instead",
                exc,
                user,
            )
        own = _directories.job_path(user, self.key)
        _directories.sweep_all(os.path.dirname(user), own=own)
        try:
            directory = _directories.job_dir(user, self.key, self._keeper)
        except (CheckpointError, OSError) as exc:
            self._off(f"no memory snapshots for this job: {exc}; restoring from the volume")
            return user, own
        self.trusted = True
        return user, directory

    def due(self, step: int) -> bool:
        """Whether ``maybe_save(step)`` snapshots (or takes part in the replicas' exchange)."""
        return (self.enabled or self.exchanging) and step % self.every == 0

    def _off(self, why: str) -> None:
        if self.enabled:
            _notes.once(
                f"off|{self.key}|{re.sub(r'[0-9]+', '#', why)}",  # a condition, not a step
                "memory snapshots are off for this run: %s; volume checkpoints go on",
                why,
            )
        self.enabled = False

    # --- what this rank holds ----------------------------------------------------

    def own(self) -> list[_slots.Slot]:
        """This rank's trusted slots, oldest first."""
        if not self.trusted:
            return []
        found = _slots.slots(self.directory, self.key, self.rank, self.world)
        return sorted(found, key=lambda s: s.step)

    def _sink(self) -> _mappings.ReplicaSink:
        """Where the replicas this rank holds are received (see ``_slots``)."""
        directory = self.directory if self.trusted else ""
        return _mappings.ReplicaSink(
            directory, self.key, self.rank, self.world, self._held_files, self._groups
        )

    def held(self, owners: list[int] | None = None) -> list[_slots.Slot]:
        """The trusted replicas this rank holds (of ``owners``; None: any), oldest first."""
        return self._sink().held(owners)

    def steps(self) -> list[int]:
        """Steps this rank holds a snapshot of, newest first."""
        self.wait()
        return sorted({s.step for s in self.own()}, reverse=True)

    # --- taking a snapshot ---------------------------------------------------------

    def _fits(self, size: int) -> bool:
        peers = len(self.receive_from) if self.exchanging else 0
        held = sum(_slots.HEADER_BYTES + s.size for s in self.own() + self.held())
        why = _directories.shortage(self.directory, self.user, size, peers, held)
        if why is not None:
            self._off(why)
        return why is None

    def _first(self, layout: _layout.Layout | None, tail: bytes) -> None:
        """Before the first snapshot: check the slots fit; exchanging ranks agree on it."""
        self._checked = True
        fits = layout is not None and self.enabled
        fits = fits and self._fits(_slots.HEADER_BYTES + layout.data_len + len(tail))  # type: ignore[union-attr]
        if self.exchanging:
            verdicts = gather(self.group, fits)
            if not all(verdicts):
                others = [r for r, ok in enumerate(verdicts) if not ok]
                self._off(f"the snapshots of rank(s) {others} do not fit on their node")
                self.exchanging = False

    def _agree_shares(self, state: dict[str, Any]) -> None:
        """Before the first snapshot (a collective): whether the ranks of this node split
        their replicated tensors between them (see ``_layout``)."""
        directory = self.directory if self.enabled else None  # off: no share to split
        self.share, self._groups = _layout.agree(self.group, self.rank, directory, state)

    def share_of(self, rank: int) -> tuple[int, int]:
        """``(base, count)`` of the ranks ``rank``'s snapshots share tensors with."""
        return self._groups.get(rank, (rank, 1))

    def snapshot(
        self, step: int, objs: dict[str, Any], extra: dict[str, Any] | None, run_id: str | None
    ) -> bool:
        """:meth:`snapshot_state` of the state a checkpoint of ``step`` holds (see ``_state``)."""
        kinds = _objects.classify(objs)
        state = _state.build_state(step, kinds, self.rank, self.world, extra or {}, run_id)
        return self.snapshot_state(step, state, [optim for optim, _ in kinds.optimizers.values()])

    def snapshot_state(
        self, step: int, state: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer] = ()
    ) -> bool:
        """Copy ``state`` into this rank's next slot, then finish it (and exchange replicas)
        in the background; whether a round was started (see :meth:`wait`).

        The tensors that only a step of one of ``optimizers`` changes are copied in the
        background too; every optimizer step waits for that copy (see ``_copy_behind``)."""
        self.wait()
        if not self.due(step):
            return False
        self._release()
        state = _sharded.flatten(state)  # DTensors: their local shards (see ``_sharded``)
        if not self._groups:
            self._agree_shares(state)
        layout: _layout.Layout | None = None
        tail = b""
        if self.enabled:
            try:
                if self.share is not None:
                    state = _layout.mark(state, self.share)
                layout = _layout.plan(state)
                tail = _layout.skeleton_bytes(layout)
            except Exception as exc:  # noqa: BLE001 - a snapshot that fails never stops training
                self._off(f"the state of step {step} cannot be snapshotted ({exc})")
        if self.enabled and not os.path.isdir(self.directory):
            try:  # another manager of this job in this process closed and removed it
                self.directory = _directories.job_dir(self.user, self.key, self._keeper)
            except Exception as exc:  # noqa: BLE001 - a snapshot that fails never stops training
                self._off(f"the snapshot directory {self.directory} cannot be made ({exc})")
        if not self._checked:
            self._first(layout, tail)
        copied: tuple[Mapped, str, Behind] | None = None
        if self.enabled and layout is not None:
            late = late_tensors(layout.tensors, optimizers if self._late else [])
            try:
                copied = self._copy(step, layout, late, optimizers if self._late else [])
            except Exception as exc:  # noqa: BLE001
                self._off(
                    f"the state of step {step} could not be copied to {self.directory} ({exc})"
                )
        if copied is None and not self.exchanging:
            return False
        # The thread ends with its round; wait() joins it. Not a daemon: a process that
        # exits lets the round finish, so it never leaves a temporary file behind.
        if copied is not None and not copied[2].copied.is_set():
            if self._gate is None:
                self._gate = StepGate()
            self._gate.hold(copied[2].copied)
        if copied is not None and copied[2].gates:
            if self._gate is None:
                self._gate = StepGate()
            self._gate.hold_gpu(copied[2].gates)
        self._writer = threading.Thread(
            target=self._round,
            args=(step, copied, layout, tail),
            name=f"nbtools-snapshot-{self.rank}",
        )
        try:
            self._writer.start()
        except BaseException:
            self._writer = None
            if copied is not None:  # no step may wait for a copy that never runs
                copied[2].copied.set()
                self._files.forget(copied[0])
                _slots.remove([copied[1]])
            raise
        return True

    def _copy(
        self,
        step: int,
        layout: _layout.Layout,
        late: list[bool],
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> tuple[Mapped, str, Behind]:
        """Copy the tensors not ``late`` into this rank's next slot file (a temporary one
        until published); the late ones are copied by the round (see ``_copy_behind``),
        and so are CUDA tensors, from pinned mirrors their copies were queued into here
        (those only a step of ``optimizers`` changes on a side stream).

        Keeps the newest complete slot while the new one is written: at most two. The
        file of the one that goes becomes the new one, with its mapping.
        """
        own = self.own()
        older = [s for s in own if s.step != step][-1:]
        drop = [s for s in own if s not in older]
        reuse = drop.pop(0) if drop else None
        _slots.remove([s.path for s in drop])
        spare = self._spare.take() if reuse is None else None
        self._spare.discard()
        tmp, fd = spare or _slots.claim(
            self.directory, self.rank, _slots.own_prefix(self.rank), reuse
        )
        mapped: Mapped | None = None
        cuda = Mirrors.wanted(layout.tensors)
        try:
            mapped = self._files.open(fd, layout.data_len)
            behind = Behind(layout.tensors, late)
            if any(cuda):  # queued, not waited for: the round reads the mirrors
                stepped_ = stepped(layout.tensors, optimizers)
                hosts, gates, ready = self._mirrors.launch(layout, cuda, stepped_)
                every = [lt or c for lt, c in zip(late, cuda, strict=True)]
                behind = Behind(layout.tensors, every, hosts, ready, gates)
            with torch.no_grad():
                dests = mapped.destinations(layout)
                for dest, tensor, later in zip(dests, layout.tensors, behind.late, strict=True):
                    if not later:
                        dest.copy_(tensor)
        except BaseException:
            if mapped is not None:
                self._files.forget(mapped)
            _slots.remove([tmp])
            raise
        return mapped, tmp, behind

    def _round(
        self,
        step: int,
        copied: tuple[Mapped, str, Behind] | None,
        layout: _layout.Layout | None,
        tail: bytes,
    ) -> None:
        """Background: copy the late tensors and checksum the slot, then (at a lower
        priority) publish it and exchange replicas with the peers."""
        out = None
        if copied is not None and layout is not None:
            mapped, tmp, behind = copied
            try:
                try:
                    crc = copy_and_checksum(mapped, layout, behind)
                    changed = behind.changed()
                finally:
                    behind.copied.set()
                _lower_priority()
                if changed:
                    self._files.forget(mapped)
                    _slots.remove([tmp])
                    self._late = False
                    dtype, shape, _ = layout.table[changed[0]]
                    self._notice = (
                        f"{len(changed)} tensor(s) of the snapshot of step {step} (the first a "
                        f"{dtype} tensor of shape {list(shape)}) changed in place before the next optimizer "
                        "step; that snapshot is dropped and snapshots copy the whole state "
                        "at once from now on (parameters are meant to change only in an "
                        "optimizer's step)"
                    )
                    copied = None
                else:
                    crc = _layout.checksum(tail, crc)
            except Exception as exc:  # noqa: BLE001 - reported by wait(), on the training thread
                self._files.forget(mapped)
                _slots.remove([tmp])
                copied = None
                self._error = (
                    f"the snapshot of step {step} could not be written to {self.directory} ({exc})"
                )
        else:
            _lower_priority()
        if copied is not None:
            mapped, tmp, _ = copied
            try:
                head: dict[str, Any] = {"rank": self.rank, "step": step, "crc": crc}
                head["share"] = list(self.share_of(self.rank))
                head.update(job=self.key, world=self.world)
                prefix = _slots.own_prefix(self.rank)
                _mappings.publish_mapped(mapped, tmp, self.directory, prefix, tail, head)
                own = self.own()
                self._files.prune({k for s in own if (k := file_key(s.path))})
                if len(own) < 2:  # the next snapshot needs a new file: make it now
                    self._spare.make(mapped.data_len)
                out = _replicas.Outgoing(step, mapped.body, tensor_of(bytearray(tail)), crc)
            except Exception as exc:  # noqa: BLE001 - reported by wait(), on the training thread
                self._files.forget(mapped)
                _slots.remove([tmp])
                self._error = (
                    f"the snapshot of step {step} could not be written to {self.directory} ({exc})"
                )
        if not self.exchanging:
            return
        try:
            lost = _replicas.exchange(
                self.group, step, out, self.send_to, self.receive_from, self._sink()
            )
        except Exception as exc:  # noqa: BLE001
            self.exchanging = False
            self._error = f"the replicas of step {step} could not be exchanged ({exc})"
            return
        for owner, why in lost:  # a condition of this holder's: said once per job
            _notes.once(f"replica|{self.key}|{self.rank}|{owner}", "%s", why, mine=True)
        self._sink().prune()

    def hand_over(self, consumed: Consumed) -> None:
        """A restore left restored state in the pages of an own slot (see ``_in_place``)."""
        self._release()
        self._consumed = consumed

    def _release(self) -> None:
        """Move the state restored in place off its slot's pages before any slot file is
        written or reused (the slot stays, see ``_in_place``)."""
        consumed, self._consumed = self._consumed, None
        if consumed is not None:
            consumed.release()

    def wait(self) -> None:
        """Block until the round in flight (if any) is complete; a round that failed turns
        the tier off with one warning."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        if self._notice is not None:
            _notes.once(f"late|{self.key}", "%s", self._notice)
            self._notice = None
        if self._error is not None:
            error, self._error = self._error, None
            self._off(error)

    # --- restoring (see ``_choice`` and ``_in_place``) ------------------------------

    def offers(self, pg: dist.ProcessGroup | None, below: Newest) -> Offer | None:
        """The newest step every rank can get from memory, fetched and checked, unless
        the volume (``below``) holds a newer one (see ``_choice``)."""
        self.wait()
        directory = self.directory if self.trusted else ""
        place = _choice.Place(directory, self.key, self.rank, self.world, self.group)
        got = _choice.offer(place, pg, below, self.volume_bound())
        if got is None and self.trusted and not self.own() and not self.held():
            others = _directories.other_worlds(self.user, self.key)
            if others:
                _notes.once(
                    f"world|{self.key}",
                    "restoring from the volume: this run's memory snapshots were taken by %s "
                    "rank(s) and it has %d now; a checkpoint on the volume is resharded by DCP",
                    " and ".join(map(str, others)),
                    self.world,
                )
        return got

    def load(
        self, pg: dist.ProcessGroup | None, offer: Offer, kinds: _objects.Objects, planner: Any
    ) -> Restored | None:
        """Put the offered step into the objects (``planner`` is the volume's: unused); the
        state restored in place stays in this rank's slot (see ``_in_place``)."""
        loaded = _in_place.load(self.rank, pg, offer, kinds)
        if loaded is None:
            return None
        if loaded.consumed is not None:
            self.hand_over(loaded.consumed)
        return loaded.restored

    def newest(self, pg: dist.ProcessGroup | None) -> Known:
        """The newest step every rank holds a snapshot of (for a tier above this one)."""

        def look() -> int | None:
            held = [set(steps) for steps in gather(pg, self.steps())]
            return max(set.intersection(*held), default=None)

        return Known(look)

    # --- what the job knows of the volume (see ``_directories``) ------------------

    def volume_bound(self) -> tuple[bool, int | None]:
        """``(known, bound)``: what the records on this node say of the volume."""
        if not self.trusted:
            return False, None
        return _directories.read_records(self.directory, self.key)

    def note_volume(self, bound: int | None) -> None:
        """Record that no checkpoint of this job on the volume is newer than ``bound``
        (None: there is none). A record that cannot be written is dropped, so that a
        restart lists the volume instead of trusting an older one."""
        self._volume = (True, bound)
        if not self.trusted:
            self._volume = (False, None)
            return
        try:
            _directories.write_record(self.directory, self.key, self.rank, bound)
        except OSError:
            self._volume = (False, None)
            with contextlib.suppress(OSError):
                _directories.remove_record(self.directory, self.rank)

    def note_volume_save(self, step: int) -> None:
        """A volume save of ``step`` is about to start: the bound moves up to it first."""
        known, bound = self._volume
        if known:
            self.note_volume(step if bound is None else max(bound, step))

    def close(self, keep: bool) -> None:
        """Remove this rank's snapshots and the replicas it holds unless ``keep`` (a close
        after an error keeps them)."""
        self.wait()
        self._spare.discard()
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        self._mirrors.close()
        self._files.close()
        self._held_files.close()
        self._release()
        if keep or not self.trusted:
            return
        _directories.remove_record(self.directory, self.rank)
        _slots.remove_rank(self.directory, self.rank)
        _slots.sweep_temporaries(self.directory, self.rank)
        _directories.drop_job_if_empty(self.directory)
