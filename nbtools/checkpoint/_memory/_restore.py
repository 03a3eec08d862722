"""Restoring from memory: the newest step every rank can get, from its own slot or a peer's.

A collective. Every rank tells the others which slots its node holds: of any
rank, its own or a replica (a restarted rank may sit on another node than its
predecessor; whoever sits on the node holding a slot serves it). The newest
step that every rank can get (from its own node, else from a rank on a node
holding it) is chosen, if it is at least as new as the volume's newest
checkpoint. Each rank then reads its slot, or receives it from that rank over
the replicas' group;
every byte is checked against the slot's checksum. A source that fails (a
damaged slot, a replica that arrives damaged) is dropped and the choice is
made again, so a rank whose own slot is corrupt takes the step from its
replica, and only when no source of a step is left do the ranks fall back to
an older step or to the volume.
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nbtools import events, runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import agree, gather
from nbtools.checkpoint._memory import _format, _replicas, _slots, _volume
from nbtools.checkpoint._memory._consumed import Consumed, holds, holes
from nbtools.checkpoint._memory._mapped import tensor_of
from nbtools.checkpoint._memory._tier import MemoryTier
from nbtools.errors import CheckpointError

__all__ = ["memory_restore", "VolumeStep", "volume_newest", "report"]

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
    offers: list[list[tuple[int, int]]], bad: set[Source], volume_step: int | None
) -> tuple[int, list[int]] | None:
    """The newest step every rank can get, and the rank each one gets it from."""
    world = len(offers)
    avail: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(world)]
    for rank, offer in enumerate(offers):
        for owner, held in offer:
            if 0 <= owner < world and (rank, owner, held) not in bad:
                avail[owner][held].append(rank)
    common = set(avail[0]).intersection(*(set(a) for a in avail[1:]))
    step = max(common, default=None)
    if step is None or (volume_step is not None and step < volume_step):
        return None
    plan = []
    for owner in range(world):  # from its own node first (no transfer), else a peer's
        sources = avail[owner][step]
        plan.append(owner if owner in sources else min(sources))
    return step, plan


def _read_any(
    tier: MemoryTier, owner: int, step: int, in_place: bool = False
) -> tuple[Any, _slots.Slot, mmap.mmap | None]:
    """The first slot of ``owner``'s ``step`` on this node that reads back whole: its
    payload, the slot, and with ``in_place`` the mapping of a rank's own slot (its
    payload is then a view of that mapping, see ``_consumed``)."""
    why = f"rank {tier.rank}'s node holds no slot of it any more"
    for slot in (s for s in tier.visible(owner) if s.step == step):
        try:
            if in_place and slot.holder is None:
                mm = _slots.map_slot(slot)
                return memoryview(mm)[_slots.HEADER_BYTES :], slot, mm
            return _slots.read_slot(slot), slot, None
        except (OSError, CheckpointError) as exc:
            _log.warning("not using %s: %s", slot.path, exc)
            why = str(exc)
    raise CheckpointError(why)


def _fetch(
    tier: MemoryTier, step: int, plan: list[int]
) -> tuple[Any, int, list[Source], str, tuple[str, mmap.mmap] | None]:
    """This rank's body of ``step`` as ``plan`` says, serving the other ranks whose source
    it is on the way: ``(body, tensor region bytes, failed sources, tier)`` (body None when
    it failed; tier ``"memory"`` for its own slot, ``"replica"`` for a replica), and the
    path and mapping of its own slot when the body is that mapping."""
    me, group = tier.rank, tier.group
    failed: list[Source] = []
    works: list[Any] = []
    keep_alive = []
    for owner, source in enumerate(plan):
        if source != me or owner == me:
            continue
        try:
            data, slot, _ = _read_any(tier, owner, step)
        except CheckpointError as exc:  # the owner must hear, then try elsewhere
            _log.warning("rank %d cannot serve rank %d's step %d: %s", me, owner, step, exc)
            failed.append((me, owner, step))
            works += _replicas.send_body(group, owner, None, 0, 0)
            continue
        keep_alive.append(data)
        works += _replicas.send_body(group, owner, tensor_of(data), slot.data_len, slot.crc)
    body: Any = None
    data_len = 0
    mine = "replica"
    mapped: tuple[str, mmap.mmap] | None = None
    if plan[me] == me:
        try:
            body, slot, mm = _read_any(tier, me, step, in_place=True)
            data_len, mine = slot.data_len, "memory" if slot.holder is None else "replica"
            mapped = (slot.path, mm) if mm is not None else None
        except CheckpointError as exc:
            _log.warning("rank %d has no usable snapshot of step %d: %s", me, step, exc)
            failed.append((me, me, step))
    else:
        got = _replicas.receive_body(group, plan[me])
        if got is not None:
            received, data_len, crc = got
            if _format.checksum(received) == crc:
                body = received
            else:
                _log.warning("rank %d's replica of step %d arrived damaged", me, step)
                failed.append((plan[me], me, step))
    for work in works:
        work.wait()
    return body, data_len, failed, mine, mapped


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
    # Without the replicas' group a rank can serve only itself.
    owners = range(tier.world) if tier.group is not None else [tier.rank]
    offer = sorted({(o, s.step) for o in owners for s in tier.visible(o)})
    offers, views = zip(*gather(pg, (offer, tier.volume_bound())), strict=True)
    known, bound = _volume.combine(list(views))

    def must_list(step: int) -> bool:
        return not known or (bound is not None and bound > step)

    bad: set[Source] = set()
    for _ in range(_ROUNDS):
        chosen = _choose(list(offers), bad, None)
        if chosen is None:
            return None
        step, plan = chosen
        if must_list(step):
            volume_step.start()  # rank 0 lists the volume while the snapshot is read
        body, data_len, failed, mine, mapped = _fetch(tier, step, plan)
        failures = [tuple(f) for fs in gather(pg, failed) for f in fs]
        if not failures:
            break
        bad.update(failures)  # type: ignore[arg-type]
    else:
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
    optimizers = [o for o, _ in kinds.optimizers.values()]
    if mapped is not None and holds(mapped[1], [o.state for o in optimizers]):
        path, mm = mapped
        live = [t for m in kinds.models.values() for t in [*m.parameters(), *m.buffers()]]
        copied = [state[name] for name in kinds.models]
        free = holes(mm, copied, live)
        tier.hand_over(Consumed(path, mm, free, optimizers))
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
