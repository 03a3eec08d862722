"""Restoring from memory: the newest step every rank can get, from its own slot or a peer's.

A collective. Every rank tells the others which slots its node holds: of any
rank, its own or a replica (a restarted rank may sit on another node than its
predecessor; whoever sits on the node holding a slot serves it). The newest
step that every rank can get (from its own node, else from a rank on a node
holding it) is chosen, if it is at least as new as the volume's newest
checkpoint; where the ranks of a node split their replicated tensors (see
``_shares``), a rank needs that step's slots of all of them. Each rank then
reads the slots it needs, or receives them from a rank that holds them over
the tier's group; every byte is checked against the slot's checksum. A source that fails (a
damaged slot, a replica that arrives damaged) is dropped and the choice is
made again, so a rank whose own slot is corrupt takes the step from its
replica, and only when no source of a step is left do the ranks fall back to
an older step or to the volume.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, NamedTuple, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nbtools._internal.log import get_logger
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import gather
from nbtools.checkpoint._memory import _format, _shares, _volume
from nbtools.checkpoint._memory._in_place import Consumed, private, within
from nbtools.checkpoint._memory._slot_sources import Fetched, Holdings, Source, fetch
from nbtools.checkpoint._restore import Newest, Offer, Restored
from nbtools.errors import CheckpointError

__all__ = ["SlotOffer", "load", "offer"]

_log = get_logger("checkpoint")
#: Rounds of choosing a step before the volume is used (each drops a failed source).
_ROUNDS = 8


def _check_fits(kinds: _state.Objects, state: dict[str, Any], where: str) -> None:
    for name, model in kinds.models.items():
        if set(state.get(name) or {}) != set(get_model_state_dict(model)):
            raise CheckpointError(f"{where} holds other parameters for {name!r}")
    for name in kinds.optimizers:
        if name not in state:
            raise CheckpointError(f"{where} holds no optimizer {name!r}")


class Restoring(Holdings, Protocol):
    """What a restore asks of the memory tier (:class:`~_tier.MemoryTier`) besides its
    slots: its round in flight finished, its records of the volume, and the slot whose
    pages restored state lives in."""

    name: str

    def wait(self) -> None: ...

    def volume_bound(self) -> tuple[bool, int | None]: ...

    def hand_over(self, consumed: Consumed) -> None: ...


class SlotOffer(NamedTuple):
    """A slot a rank's node holds: ``owner``'s snapshot of ``step``, whose replicated
    tensors ranks ``base`` to ``base + width - 1`` share (see ``_shares``)."""

    owner: int
    step: int
    base: int
    width: int


def _choose(
    offers: list[list[SlotOffer]], bad: set[Source], remote: bool
) -> tuple[int, list[int], list[range]] | None:
    """The newest step every rank can get whole, the rank each owner's slot is read from,
    and the owners whose slots each rank needs (its own and those it shares tensors with,
    see ``_shares``). Without ``remote`` a rank can only read what its node holds."""
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


def offer(tier: Restoring, pg: dist.ProcessGroup | None, below: Newest) -> Offer | None:
    """The newest step every rank can get from memory (own slots, or peers' replicas),
    fetched and checked, when it is at least as new as the volume's (a collective).

    The volume is not listed when the ranks' records (``_volume``) show that it
    holds nothing newer than the chosen snapshot. Otherwise ``below`` lists it
    (rank 0, in the background, while the snapshot is read and checked) and
    gives every rank the newest complete step. None (after one line saying why)
    when the volume must be used.
    """
    tier.wait()
    # Without the group (a single rank) a rank can read and serve only itself.
    owners = range(tier.world) if tier.group is not None else [tier.rank]
    mine = {SlotOffer(o, s.step, *(s.share or (o, 1))) for o in owners for s in tier.visible(o)}
    offers, views = zip(*gather(pg, (sorted(mine), tier.volume_bound())), strict=True)
    offers = tuple([SlotOffer(*o) for o in got] for got in offers)
    known, bound = _volume.combine(list(views))
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
    return Offer(tier.name, step, newest_volume, got)


def load(
    tier: Restoring, pg: dist.ProcessGroup | None, offer: Offer, kinds: _state.Objects
) -> Restored | None:
    """Put the slots ``offer`` holds into the objects on every rank (a collective); None
    (the objects unchanged, after one line saying why) when some rank cannot."""
    step, got = offer.step, offer.held
    assert step is not None and isinstance(got, Fetched)
    where = f"the memory snapshot of step {step} of rank {tier.rank}"
    state: dict[str, Any] = {}
    blob: dict[str, Any] = {}
    error = ""
    try:
        with warnings.catch_warnings():  # peers' slots are mapped read-only: only read
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            peers = {o: _format.decode(*b) for o, b in got.bodies.items() if o != tier.rank}
        state = _shares.fill(_format.decode(*got.bodies[tier.rank]), peers, where)
        _check_fits(kinds, state, where)
        mapped = [mm for _, mm, _ in got.peers.values()]
        for name in kinds.optimizers:  # the optimizer keeps what it loads: its own copy
            state[name] = private(state[name], mapped)
        blob = _state.decode_blob({_state.NS: state[_state.NS]}, kinds, where)
    except Exception as exc:  # noqa: BLE001 - every rank must learn it, then use the volume
        error = f"{type(exc).__name__}: {exc}"
    errors = gather(pg, error)
    if any(errors):
        first = next(e for e in errors if e)
        _log.warning("not restoring step %d from memory (%s); using the volume", step, first)
        return None
    _state.apply_state(kinds, state, blob)
    optimizers = [o for o, _ in kinds.optimizers.values()]
    if got.mapped is not None:
        path, mm = got.mapped
        live = [t for m in kinds.models.values() for t in [*m.parameters(), *m.buffers()]]
        inside = within(mm, [[o.state for o in optimizers], live])
        if inside:
            tier.hand_over(Consumed(path, mm, inside, optimizers))
    mine = "replica" if got.replica else "memory"
    from_peers = [r for r, t in enumerate(gather(pg, mine)) if t == "replica"]
    _log.info(
        "restored step %d from %s; resuming at step %d",
        step,
        f"memory (ranks {from_peers} from replicas)" if from_peers else "memory",
        step + 1,
    )
    source = "replica" if from_peers else "memory"
    return Restored(
        step,
        mine,
        blob,
        [],
        blob.get("mlflow_run_id"),
        saved_step=offer.volume,
        where=f"step {step} from {source}",
        from_replicas=bool(from_peers),
    )
