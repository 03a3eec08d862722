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

import threading
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nbtools import events, runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import agree, gather
from nbtools.checkpoint._memory import _format, _shares, _volume
from nbtools.checkpoint._memory._in_place import Consumed, private, within
from nbtools.checkpoint._memory._slot_sources import Source, fetch
from nbtools.checkpoint._memory._tier import MemoryTier
from nbtools.errors import CheckpointError

__all__ = ["memory_restore", "VolumeStep", "volume_newest", "report"]

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


Offer = tuple[int, int, int, int]  # (owner, step, share base, share count)


def _choose(
    offers: list[list[Offer]], bad: set[Source], remote: bool
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
    offers: tuple[list[Offer], ...], failed: tuple[int, list[int]] | None, step: int | None
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
        newest = [max((s for _, s, *_ in got), default=None) for got in offers]
        _log.warning(
            "restoring from the volume: no memory snapshot of a step every rank can get "
            "(the newest each rank's node holds: %s)",
            newest,
        )


def memory_restore(
    tier: MemoryTier, kinds: _state.Objects, pg: Any, volume_step: VolumeStep
) -> tuple[int, dict[str, Any], str, bool, int | None] | None:
    """Restore from memory (own slots, or peers' replicas) when every rank can get a step
    at least as new as the volume's.

    The volume is not listed when the ranks' records (``_volume``) show that it
    holds nothing newer than the chosen snapshot. Otherwise ``volume_step`` lists
    it (rank 0, in the background, while the snapshot is read and checked) and
    gives every rank the newest complete step (a collective, see :class:`VolumeStep`).

    Returns ``(step, blob, tier, any_replica, volume_step)`` once the objects hold
    the snapshot, ``tier`` being where this rank's came from (``"memory"`` or
    ``"replica"``) and ``any_replica`` whether some rank's came from a replica; or
    None (nothing changed) when the volume must be used.
    """
    tier.wait()
    # Without the group (a single rank) a rank can read and serve only itself.
    owners = range(tier.world) if tier.group is not None else [tier.rank]
    offer = sorted({(o, s.step, *(s.share or (o, 1))) for o in owners for s in tier.visible(o)})
    offers, views = zip(*gather(pg, (offer, tier.volume_bound())), strict=True)
    known, bound = _volume.combine(list(views))
    here = {(r, o, s) for r, got in enumerate(offers) for o, s, *_ in got}

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
            volume_step.start()  # rank 0 lists the volume while the snapshot is read
        got = fetch(tier, step, plan, needs, here - bad)
        reports = gather(pg, (got.failed, sorted(got.verified)))
        failures = [tuple(f) for fs, _ in reports for f in fs]
        late = got.check(tier.rank, {tuple(v) for _, vs in reports for v in vs})
        failures += [tuple(f) for fs in gather(pg, late) for f in fs]
        if not failures:
            break
        bad.update(failures)  # type: ignore[arg-type]
        failed = step, sorted({owner for _, owner, _ in failures})
    else:
        _log.warning("restoring from the volume: the memory snapshots failed %d times", _ROUNDS)
        return None
    newest_volume = volume_step() if must_list(step) else bound
    if newest_volume is not None and step < newest_volume:
        _log.info("the volume's step %d is newer than memory's %d", newest_volume, step)
        return None
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
    return step, blob, mine, bool(from_peers), newest_volume


def volume_newest(target: Any) -> int | None:
    """The newest complete checkpoint's step under ``target`` (rank 0 only reads it)."""
    from nbtools.checkpoint.discovery import list_steps

    return next((step for step, complete in list_steps(target) if complete), None)


class VolumeStep:
    """The volume's newest complete step, looked up by rank 0 in the background
    (``target()`` gives the volume's target).

    Listing a bucket takes round trips (and, in a fresh process, the client's
    start): :meth:`start` begins it, to overlap with reading the memory snapshot.
    Calling the object is a collective that gives every rank rank 0's answer
    (starting the lookup if needed); rank 0's error is raised on every rank. Use
    it as a context manager: leaving joins a lookup in progress.
    """

    def __init__(self, pg: Any, target: Callable[[], Any]) -> None:
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

    def _look(self, target: Any) -> None:
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
