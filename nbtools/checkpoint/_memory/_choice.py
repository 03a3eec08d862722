"""The choice of step a restore from memory makes, and getting its slots.

A collective. Every rank tells the others which slots its node holds: of any
rank, its own or a replica (a restarted rank may sit on another node than its
predecessor; whoever sits on the node holding a slot serves it). The newest
step that every rank can get (from its own node, else from a rank on a node
holding it) is chosen, if it is at least as new as the volume's newest
checkpoint (the ranks' records, see ``_directories``, else a listing); where
the ranks of a node split their replicated tensors (see ``_layout``), a rank
needs that step's slots of all of them.

Each rank then gets the slots it needs (:func:`fetch`). Those its node holds it
reads there: its own slot mapped in place and checked (see ``_in_place``), a
peer's slot mapped read-only and checked once, by whichever rank of the node
maps it as its own (:meth:`Fetched.check`); the others it receives from the
rank the plan names, which reads them (checked) and sends them over the tier's
group, checked again on arrival. A source that fails (a damaged slot, a replica
that arrives damaged) is dropped and the choice is made again, so a rank whose
own slot is corrupt takes the step from its replica, and only when no source of
a step is left do the ranks fall back to an older step or to the volume.

A body mapped from a peer's slot is only read from (the tensors it holds are
copied into the model, and what the optimizer kept of them on the host is
cloned, before the restore ends): that rank's own restore keeps its optimizer
state in those pages until its first step.
"""

from __future__ import annotations

import mmap
import os
from collections import defaultdict
from typing import Any, NamedTuple

import torch.distributed as dist

from nbtools._internal.holder import machine_id
from nbtools._internal.log import get_logger
from nbtools.checkpoint._collective import gather
from nbtools.checkpoint._memory import _layout, _notes, _replicas, _slots
from nbtools.checkpoint._restore import Newest, Offer
from nbtools.errors import CheckpointError

__all__ = ["Fetched", "Place", "SlotOffer", "Source", "fetch", "offer", "read_any"]

_log = get_logger("checkpoint")
#: Rounds of choosing a step before the volume is used (each drops a failed source).
_ROUNDS = 8


class Place(NamedTuple):
    """Where this rank's node keeps the job's slots (``directory`` is "" when it cannot be
    trusted), and the tier's group for the transfers."""

    directory: str
    key: str
    rank: int
    world: int
    group: dist.ProcessGroup | None

    def visible(self, owner: int) -> list[_slots.Slot]:
        """Every trusted slot of ``owner`` on this node: its own first, then replicas."""
        if not self.directory:
            return []
        return list(_slots.visible(self.directory, self.key, owner, self.world))


class Source(NamedTuple):
    """Where a restore gets a slot: the rank ``holder``, whose node holds ``owner``'s
    snapshot of ``step``."""

    holder: int
    owner: int
    step: int


FileId = tuple[str, int, int]  # (machine, device, inode)


def read_any(
    tier: Place, owner: int, step: int, in_place: bool = False
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
        held = _layout.step_of(body, slot.data_len)
    except ValueError as exc:
        raise CheckpointError(f"snapshot {slot.path} of step {slot.step}: {exc}") from None
    if held != slot.step:
        raise CheckpointError(
            f"snapshot {slot.path} holds step {held} where its header says {slot.step}; "
            "it is not used"
        )


def _map_any(tier: Place, owner: int, step: int) -> tuple[_slots.Slot, mmap.mmap, FileId]:
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
    tier: Place, step: int, plan: list[int], needs: list[range], local: set[Source]
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
            works += _replicas.send_body(
                group, r, _slots.tensor_of(data), slot.data_len, slot.crc, owner
            )
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
                held = _layout.step_of(received, data_len)
            except ValueError:
                held = None
            if _layout.checksum(received) == crc and held == step:
                out.bodies[owner] = (received, data_len)
            else:
                _log.warning("rank %d's snapshot of step %d arrived damaged", owner, step)
                out.failed.append(Source(plan[owner], owner, step))
    for work in works:
        work.wait()
    return out


# --- the choice ------------------------------------------------------------------


def _combine(views: list[tuple[bool, int | None]]) -> tuple[bool, int | None]:
    """What the records of every rank's node say together of the volume (see
    ``_directories``): whether any rank has one, and the newest step they bound it by."""
    known = [bound for seen, bound in views if seen]
    steps = [b for b in known if b is not None]
    return bool(known), max(steps, default=None)


class SlotOffer(NamedTuple):
    """A slot a rank's node holds: ``owner``'s snapshot of ``step``, whose replicated
    tensors ranks ``base`` to ``base + width - 1`` share (see ``_layout``)."""

    owner: int
    step: int
    base: int
    width: int


def _choose(
    offers: list[list[SlotOffer]], bad: set[Source], remote: bool
) -> tuple[int, list[int], list[range]] | None:
    """The newest step every rank can get whole, the rank each owner's slot is read from,
    and the owners whose slots each rank needs (its own and those it shares tensors with,
    see ``_layout``). Without ``remote`` a rank can only read what its node holds."""
    world = len(offers)
    avail: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(world)]
    shares: dict[tuple[int, int], range] = {}
    for rank, offer in enumerate(offers):
        for owner, held, base, count in offer:
            if 0 <= owner < world and (rank, owner, held) not in bad:
                avail[owner][held].append(rank)
                shares.setdefault((owner, held), range(base, base + count))

    def whole(step: int) -> bool:
        for rank in range(world):
            for owner in shares[(rank, step)]:
                sources = avail[owner].get(step) if 0 <= owner < world else None
                if not sources or (not remote and rank not in sources):
                    return False
        return True

    common = set(avail[0]).intersection(*(set(a) for a in avail[1:]))
    step = next((s for s in sorted(common, reverse=True) if whole(s)), None)
    if step is None:
        return None
    # From the owner's own node first (no transfer), else a peer's.
    plan = [o if o in avail[o][step] else min(avail[o][step]) for o in range(world)]
    return step, plan, [shares[(rank, step)] for rank in range(world)]


def _say_fallback(
    offers: tuple[list[SlotOffer], ...], failed: tuple[int, list[int]] | None, step: int | None
) -> None:
    """One line when the restore goes to an older step or tier than it could have, and why."""
    if failed is not None:
        where = f"step {step} from memory" if step is not None else "the volume"
        _log.warning(
            "restoring %s: the snapshots of step %d of rank(s) %s failed their checks",
            where,
            failed[0],
            failed[1],
        )
    elif step is None and any(offers):
        newest = [max((o.step for o in got), default=None) for got in offers]
        _log.warning(
            "restoring from the volume: no memory snapshot of a step every rank can get "
            "(the newest each rank's node holds: %s)",
            newest,
        )


def offer(
    tier: Place, pg: dist.ProcessGroup | None, below: Newest, records: tuple[bool, int | None]
) -> Offer | None:
    """The newest step every rank can get from memory (own slots, or peers' replicas),
    fetched and checked, when it is at least as new as the volume's (a collective).

    The volume is not listed when the ranks' records (``_directories``) show that it
    holds nothing newer than the chosen snapshot. Otherwise ``below`` lists it
    (rank 0, in the background, while the snapshot is read and checked) and
    gives every rank the newest complete step. None (after one line saying why)
    when the volume must be used.
    """
    # Without the group (a single rank) a rank can read and serve only itself.
    owners = range(tier.world) if tier.group is not None else [tier.rank]
    mine = {SlotOffer(o, s.step, *(s.share or (o, 1))) for o in owners for s in tier.visible(o)}
    offers, views = zip(*gather(pg, (sorted(mine), records)), strict=True)
    offers = tuple([SlotOffer(*o) for o in got] for got in offers)
    known, bound = _combine(list(views))
    here = {Source(r, o.owner, o.step) for r, got in enumerate(offers) for o in got}

    def must_list(step: int) -> bool:
        return not known or (bound is not None and bound > step)

    bad: set[Source] = set()
    failed: tuple[int, list[int]] | None = None  # the step that failed and whose slots
    for _ in range(_ROUNDS):
        chosen = _choose(list(offers), bad, tier.group is not None)
        _say_fallback(offers, failed, chosen[0] if chosen else None)
        if chosen is None:
            return None
        step, plan, needs = chosen
        if must_list(step):
            below.start()  # rank 0 lists the volume while the snapshot is read
        got = fetch(tier, step, plan, needs, here - bad)
        reports = gather(pg, (got.failed, sorted(got.verified)))
        failures = [Source(*f) for fs, _ in reports for f in fs]
        late = got.check(tier.rank, {tuple(v) for _, vs in reports for v in vs})
        failures += [Source(*f) for fs in gather(pg, late) for f in fs]
        if not failures:
            break
        bad.update(failures)
        failed = step, sorted({f.owner for f in failures})
    else:
        _log.warning("restoring from the volume: the memory snapshots failed %d times", _ROUNDS)
        return None
    newest_volume = below() if must_list(step) else bound
    if newest_volume is not None and step < newest_volume:
        _log.info("the volume's step %d is newer than memory's %d", newest_volume, step)
        return None
    return Offer("memory", step, newest_volume, got)
