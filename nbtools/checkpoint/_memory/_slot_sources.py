"""Getting the slots a restore chose: read where they are, else sent by a rank that has them.

A rank needs its own slot of the chosen step and, where the ranks of its node
split their replicated tensors (see ``_shares``), the slots of the same step of
every rank it shares with. Those its node holds it reads there: its own slot
mapped in place and checked (see ``_in_place``), a peer's slot mapped read-only
and checked once, by whichever rank of the node maps it as its own (:meth:`Fetched.check`);
the others it receives from the rank the plan names, which reads them (checked)
and sends them over the tier's group, checked again on arrival.

A body mapped from a peer's slot is only read from (the tensors it holds are
copied into the model, or cloned for the optimizer, before the restore ends):
that rank's own restore keeps its optimizer state in those pages and changes
them at its first step.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, NamedTuple, Protocol

import torch.distributed as dist

from nbtools._internal.holder import machine_id
from nbtools._internal.log import get_logger
from nbtools.checkpoint._memory import _format, _notes, _replicas, _slots
from nbtools.checkpoint._memory._slot_maps import tensor_of
from nbtools.errors import CheckpointError

__all__ = ["Fetched", "Holdings", "Source", "fetch", "read_any"]

_log = get_logger("checkpoint")


class Holdings(Protocol):
    """What a restore reads of the memory tier: this rank, the world, the tier's group, and
    the trusted slots of an owner its node holds (:meth:`~_tier.MemoryTier.visible`)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None

    def visible(self, owner: int) -> list[_slots.Slot]: ...


class Source(NamedTuple):
    """Where a restore gets a slot: the rank ``holder``, whose node holds ``owner``'s
    snapshot of ``step``."""

    holder: int
    owner: int
    step: int


FileId = tuple[str, int, int]  # (machine, device, inode)


def read_any(
    tier: Holdings, owner: int, step: int, in_place: bool = False
) -> tuple[Any, _slots.Slot, mmap.mmap | None]:
    """The first slot of ``owner``'s ``step`` on this node that reads back whole: its
    payload, the slot, and with ``in_place`` the mapping of a rank's own slot (its
    payload is then a view of that mapping, see ``_in_place``)."""
    why = f"rank {tier.rank}'s node holds no slot of it any more"
    for slot in (s for s in tier.visible(owner) if s.step == step):
        mm = None
        try:
            if in_place and slot.holder is None:
                mm = _slots.map_slot(slot)
                body: Any = memoryview(mm)[_slots.HEADER_BYTES :]
            else:
                body = _slots.read_slot(slot)
            _check_step(body, slot)
            return body, slot, mm
        except (OSError, CheckpointError) as exc:
            _notes.once(f"skip|{slot.path}", "not using %s: %s", slot.path, exc)
            why = str(exc)
    raise CheckpointError(why)


def _check_step(body: Any, slot: _slots.Slot) -> None:
    """Raise unless the snapshot in ``body`` holds the step ``slot``'s header claims.

    Raises:
        CheckpointError: It holds another step, or its skeleton cannot be read.
    """
    try:
        held = _format.step_of(body, slot.data_len)
    except ValueError as exc:
        raise CheckpointError(f"snapshot {slot.path} of step {slot.step}: {exc}") from None
    if held != slot.step:
        raise CheckpointError(
            f"snapshot {slot.path} holds step {held} where its header says {slot.step}; "
            "it is not used"
        )


def _map_any(tier: Holdings, owner: int, step: int) -> tuple[_slots.Slot, mmap.mmap, FileId]:
    """The first slot of ``owner``'s ``step`` on this node that maps, read-only, unchecked."""
    why = f"rank {tier.rank}'s node holds no slot of it any more"
    for slot in (s for s in tier.visible(owner) if s.step == step):
        try:
            mm, (device, inode) = _slots.map_peer(slot)
            try:
                with memoryview(mm) as whole, whole[_slots.HEADER_BYTES :] as body:
                    _check_step(body, slot)
            except CheckpointError:
                mm.close()
                raise
            return slot, mm, (machine_id(), device, inode)
        except (OSError, CheckpointError) as exc:
            _notes.once(f"skip|{slot.path}", "not using %s: %s", slot.path, exc)
            why = str(exc)
    raise CheckpointError(why)


class Fetched:
    """What :func:`fetch` got for one rank.

    Attributes:
        bodies: Each needed owner's payload and tensor region bytes.
        failed: The sources that failed, ``(rank, owner, step)``.
        replica: Whether any body was a replica (a holder's copy, here or sent).
        mapped: The path and mapping of this rank's own slot when restored in place.
        verified: The files this rank checked whole (its own slot, mapped in place).
        peers: The mappings of other ranks' slots, and their files, not checked yet.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.bodies: dict[int, tuple[Any, int]] = {}
        self.failed: list[Source] = []
        self.replica = False
        self.mapped: tuple[str, mmap.mmap] | None = None
        self.verified: set[FileId] = set()
        self.peers: dict[int, tuple[_slots.Slot, mmap.mmap, FileId]] = {}

    def check(self, me: int, verified: set[FileId]) -> list[Source]:
        """Check each peer's slot mapped here that no rank checked (``verified``: the
        files every rank checked whole); the sources that fail, their bodies dropped."""
        failed: list[Source] = []
        for owner, (slot, mm, file) in list(self.peers.items()):
            if file in verified:
                continue
            try:
                _slots.verify(mm, slot)
            except CheckpointError as exc:
                _notes.once(f"skip|{slot.path}", "not using %s: %s", slot.path, exc)
                failed.append(Source(me, owner, self.step))
                del self.bodies[owner], self.peers[owner]
        return failed


def fetch(
    tier: Holdings, step: int, plan: list[int], needs: list[range], local: set[Source]
) -> Fetched:
    """The bodies of ``step`` this rank needs, read here or received as ``plan`` says,
    serving the ranks that need a body this rank is the source of and cannot read it
    where they are (``local``: ``(rank, owner, step)`` a rank can read on its node)."""
    me, group = tier.rank, tier.group
    out = Fetched(step)
    works: list[Any] = []
    keep_alive = []
    for owner, source in enumerate(plan):
        if source != me:
            continue
        to = [r for r, need in enumerate(needs) if owner in need and (r, owner, step) not in local]
        if not to:
            continue
        try:
            data, slot, _ = read_any(tier, owner, step)
        except CheckpointError as exc:  # the ranks must hear, then try elsewhere
            _log.info("rank %d cannot serve rank %d's step %d: %s", me, owner, step, exc)
            out.failed.append(Source(me, owner, step))
            for r in to:
                works += _replicas.send_body(group, r, None, 0, 0, owner)
            continue
        keep_alive.append(data)
        for r in to:
            works += _replicas.send_body(group, r, tensor_of(data), slot.data_len, slot.crc, owner)
    for owner in needs[me]:
        if (me, owner, step) in local:
            try:
                if owner == me:
                    body, slot, mm = read_any(tier, owner, step, in_place=True)
                else:
                    slot, mm, file = _map_any(tier, owner, step)
                    body = memoryview(mm)[_slots.HEADER_BYTES :]
                    out.peers[owner] = (slot, mm, file)
                    mm = None
            except CheckpointError as exc:
                _log.info("rank %d cannot read rank %d's step %d: %s", me, owner, step, exc)
                out.failed.append(Source(me, owner, step))
                continue
            out.bodies[owner] = (body, slot.data_len)
            out.replica = out.replica or slot.holder is not None
            if mm is not None:
                out.mapped = (slot.path, mm)
                info = os.stat(slot.path)
                out.verified.add((machine_id(), info.st_dev, info.st_ino))
            continue
        got = _replicas.receive_body(group, plan[owner], owner)
        out.replica = True
        if got is not None:
            received, data_len, crc = got
            try:
                held = _format.step_of(received, data_len)
            except ValueError:
                held = None
            if _format.checksum(received) == crc and held == step:
                out.bodies[owner] = (received, data_len)
            else:
                _log.warning("rank %d's snapshot of step %d arrived damaged", owner, step)
                out.failed.append(Source(plan[owner], owner, step))
    for work in works:
        work.wait()
    return out
