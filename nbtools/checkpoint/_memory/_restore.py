"""Restoring from memory: the newest step every rank can get, from its own slot or a peer's.

A collective. Every rank tells the others which steps it holds: its own slots
and the replicas it keeps for its peers. The newest step that every rank can
get (from its own slot, else from a rank holding its replica) is chosen, if it
is at least as new as the volume's newest checkpoint. Each rank then reads its
own slot, or receives its replica from the holder over the replicas' group;
every byte is checked against the slot's checksum. A source that fails (a
damaged slot, a replica that arrives damaged) is dropped and the choice is
made again, so a rank whose own slot is corrupt takes the step from its
replica, and only when no source of a step is left do the ranks fall back to
an older step or to the volume.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nbtools import events, runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import agree, gather
from nbtools.checkpoint._memory import _format, _replicas, _slots
from nbtools.checkpoint._memory._mapped import tensor_of
from nbtools.checkpoint._memory._tier import MemoryTier
from nbtools.errors import CheckpointError

__all__ = ["memory_restore", "agreed_volume_step", "volume_newest", "report"]

_log = get_logger("checkpoint")
#: Rounds of choosing a step before the volume is used (each drops a failed source).
_ROUNDS = 8

Source = tuple[int, int, int]  # (rank holding it, owner, step)


def _check_fits(kinds: _state.Objects, state: dict[str, Any], where: str) -> None:
    for name, model in kinds.models.items():
        if set(state.get(name) or {}) != set(get_model_state_dict(model)):
            raise CheckpointError(f"{where} holds other parameters for {name!r}")
    for name in kinds.optimizers:
        if name not in state:
            raise CheckpointError(f"{where} holds no optimizer {name!r}")


def _choose(
    offers: list[dict[str, Any]], bad: set[Source], volume_step: int | None
) -> tuple[int, list[int]] | None:
    """The newest step every rank can get, and the rank each one gets it from."""
    world = len(offers)
    avail: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(world)]
    for rank, offer in enumerate(offers):
        for step in offer["own"]:
            if (rank, rank, step) not in bad:
                avail[rank][step].append(rank)
        for owner, step in offer["held"]:
            if 0 <= owner < world and (rank, owner, step) not in bad:
                avail[owner][step].append(rank)
    common = set(avail[0]).intersection(*(set(a) for a in avail[1:]))
    step = max(common, default=None)
    if step is None or (volume_step is not None and step < volume_step):
        return None
    # Its own slot first (no transfer), then the holders in rank order.
    plan = []
    for owner in range(world):
        sources = avail[owner][step]
        plan.append(owner if owner in sources else min(sources))
    return step, plan


def _fetch(tier: MemoryTier, step: int, plan: list[int]) -> tuple[Any, int, list[Source]]:
    """This rank's body of ``step`` as ``plan`` says, serving the replicas it holds on the
    way: ``(body, tensor region bytes, failed sources)`` (body None when it failed)."""
    me, group = tier.rank, tier.group
    failed: list[Source] = []
    works: list[Any] = []
    keep_alive = []
    for owner, source in enumerate(plan):
        if source != me or owner == me:
            continue
        slot = next((s for s in tier.held([owner]) if s.step == step), None)
        try:
            if slot is None:
                raise CheckpointError(f"rank {me} no longer holds it")
            data = _slots.read_slot(slot)
        except Exception as exc:  # noqa: BLE001 - the owner must hear, then try elsewhere
            _log.warning("the replica of rank %d's step %d on rank %d: %s", owner, step, me, exc)
            failed.append((me, owner, step))
            works += _replicas.send_body(group, owner, None, 0, 0)
            continue
        keep_alive.append(data)
        works += _replicas.send_body(group, owner, tensor_of(data), slot.data_len, slot.crc)
    body: Any = None
    data_len = 0
    if plan[me] == me:
        slot = next((s for s in tier.own() if s.step == step), None)
        try:
            if slot is None:
                raise CheckpointError(f"rank {me}'s snapshot of step {step} is gone")
            body, data_len = _slots.read_slot(slot), slot.data_len
        except Exception as exc:  # noqa: BLE001
            _log.warning("not using rank %d's own snapshot of step %d: %s", me, step, exc)
            failed.append((me, me, step))
    else:
        got = _replicas.receive_body(group, plan[me])
        if got is not None:
            received, data_len, crc = got
            if zlib.crc32(received) == crc:
                body = received
            else:
                _log.warning("rank %d's replica of step %d arrived damaged", me, step)
                failed.append((plan[me], me, step))
    for work in works:
        work.wait()
    return body, data_len, failed


def memory_restore(
    tier: MemoryTier, kinds: _state.Objects, pg: Any, volume_step: int | None
) -> tuple[int, dict[str, Any], str, bool] | None:
    """Restore from memory (own slots, or peers' replicas) when every rank can get a step
    at least as new as the volume's.

    Returns ``(step, blob, tier, any_replica)`` once the objects hold the snapshot,
    ``tier`` being where this rank's came from (``"memory"`` or ``"replica"``) and
    ``any_replica`` whether some rank's came from a replica; or None (nothing
    changed) when the volume must be used.
    """
    tier.wait()
    replicas = tier.group is not None
    offer = {
        "own": sorted({s.step for s in tier.own()}),
        "held": sorted({(s.rank, s.step) for s in tier.held()}) if replicas else [],
    }
    offers = gather(pg, offer)
    bad: set[Source] = set()
    for _ in range(_ROUNDS):
        chosen = _choose(offers, bad, volume_step)
        if chosen is None:
            return None
        step, plan = chosen
        body, data_len, failed = _fetch(tier, step, plan)
        failures = [tuple(f) for fs in gather(pg, failed) for f in fs]
        if not failures:
            break
        bad.update(failures)  # type: ignore[arg-type]
    else:
        return None
    where = f"the memory snapshot of step {step} of rank {tier.rank}"
    state: dict[str, Any] = {}
    blob: dict[str, Any] = {}
    error = ""
    try:
        state = _format.decode(body, data_len)
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
    mine = "memory" if plan[tier.rank] == tier.rank else "replica"
    from_peers = [o for o, s in enumerate(plan) if s != o]
    _log.info(
        "restored step %d from %s; resuming at step %d",
        step,
        f"memory (ranks {from_peers} from their replicas)" if from_peers else "memory",
        step + 1,
    )
    return step, blob, mine, bool(from_peers)


def volume_newest(target: Any) -> int | None:
    """The newest complete checkpoint's step under ``target`` (rank 0 only reads it)."""
    from nbtools.checkpoint.discovery import list_steps

    return next((step for step, complete in list_steps(target) if complete), None)


def agreed_volume_step(pg: Any, target: Any) -> int | None:
    """:func:`volume_newest`, read by rank 0 and known to every rank."""
    return agree(pg, volume_newest(target) if runtime.get_rank() == 0 else None)


def report(step: int, seconds: float, tier: str) -> None:
    """The ``checkpoint_restored`` event of a restore from memory (rank 0): ``tier`` is
    ``"replica"`` when some rank's state came from a peer's replica, else ``"memory"``."""
    if runtime.get_rank() == 0:
        events.emit(
            "checkpoint_restored",
            message=f"restored step {step} from {tier}",
            step=step,
            seconds=round(seconds, 4),
            tier=tier,
        )
