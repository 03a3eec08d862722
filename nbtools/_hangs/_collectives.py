"""Which collective each rank is in, from torch's Flight Recorder, in words.

When the watchdog finds ranks that stopped, it asks them where they are
(:func:`ask`, over the events channel: ``events.ask_collectives``) and gets
back, per rank and process group, a :class:`Position`: the last collective
the rank enqueued, the last that completed, and the name and size of the
last one recorded. From those it tells a rank that never entered the
collective its peers wait in (the culprit) from the ranks that only wait,
and ranks that entered different collectives at the same position (a
mismatch: both are culprits).

The words (:func:`describe`): "ranks 0, 2, 3 wait in all_reduce #1812,
which rank 1 never entered (last entered: rank 1: #1811)", or "rank 0 is in
all_reduce #68 (4 KB), rank 1 in broadcast #68: a mismatched collective".
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from nbtools import events

__all__ = ["Position", "InFlight", "ask", "in_flight", "describe", "culprits_of", "stood_still"]


class Pending(NamedTuple):
    """A collective a rank issued and did not see complete."""

    seq: int
    op: str
    size: int | None
    state: str  # "scheduled" (issued), "started" (running on the device; NCCL with timing)


class Position(NamedTuple):
    """Where one rank is in one process group (``"nccl:0"``), from its Flight Recorder."""

    pg: str
    enqueued: int  # the last collective issued
    completed: int  # the last one finished
    op: str | None  # the name of the last one recorded
    op_seq: int | None  # ... and its number
    size: int | None  # ... and its input's bytes, when recorded
    pending: tuple[Pending, ...] = ()  # those issued and not completed, oldest first
    gpu_util: float | None = None  # the rank's GPU's utilisation (NVML, percent)

    @property
    def inside(self) -> bool:
        """The rank entered a collective that has not completed."""
        return self.enqueued > self.completed

    @property
    def backend(self) -> str:
        """``nccl``, ``gloo``, ...: the group key's prefix (a key without one: gloo's)."""
        return self.pg.split(":", 1)[0] if ":" in self.pg else "gloo"

    def at(self, seq: int) -> Pending | None:
        """The collective ``seq``, when the rank issued it and did not see it complete."""
        for each in self.pending:
            if each.seq == seq:
                return each
        if self.op is not None and self.op_seq == seq and self.enqueued >= seq > self.completed:
            return Pending(seq, self.op, self.size, "")
        return None

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Position:
        """From the fields of one ``collectives`` answer."""
        pending = []
        for item in str(fields.get("pending") or "").split(";"):
            seq, op, size, state = (item.split(":") + ["", "", "", ""])[:4]
            if seq.isdigit() and op:
                pending.append(Pending(int(seq), op, int(size) if size.isdigit() else None, state))
        util = fields.get("gpu_util")
        return cls(
            str(fields.get("pg")),
            int(fields.get("enqueued", -1)),
            int(fields.get("completed", -1)),
            fields.get("op"),
            fields.get("op_seq"),
            fields.get("bytes"),
            tuple(pending),
            float(util) if isinstance(util, (int, float)) else None,
        )


class InFlight(NamedTuple):
    """The collective in flight in one process group."""

    op: str  # its name ("a collective" when no rank in it recorded one)
    seq: int  # its number
    inside: list[int]  # the ranks in it
    behind: dict[int, int]  # rank -> the last it entered, for ranks that never entered it
    ops: dict[int, tuple[str, int | None]]  # rank -> (op, bytes) of each rank in it, recorded
    backend: str = "gloo"  # the group's backend
    states: dict[int, str] | None = None  # rank -> its record's state of it ("started", ...)
    utils: dict[int, float] | None = None  # rank -> its GPU's utilisation, when read


def ask(
    expected: set[int], pids: dict[int, int], stop: threading.Event | None = None
) -> dict[int, list[Position]]:
    """Ask the ranks where they are; wait a few seconds for the ``expected`` ones.

    Args:
        expected: Ranks that may answer (a stopped one cannot).
        pids: Each known rank's process id: answers from another process (a rank
            of another group) are left out.
        stop: Set to give up waiting.

    Returns:
        ``rank -> positions`` of the ranks that answered.
    """
    with events.ask_collectives() as request:
        answers = request.wait(expected, stop=stop)
    return {
        rank: [Position.of(e.fields) for e in found if pids.get(rank) in (None, e.pid)]
        for rank, found in answers.items()
        if any(pids.get(rank) in (None, e.pid) for e in found)
    }


def in_flight(answers: dict[int, list[Position]]) -> list[InFlight]:
    """The collective in flight in each process group where some rank is inside one.

    Groups are keyed by backend and id. On NCCL the stuck collective is the one
    after the lowest a rank completed (``min(completed) + 1``): ranks that issued it
    (NCCL ranks may have run ahead by any number) wait in it; ranks that never issued
    it are behind. On gloo, whose record counts a collective completed only some
    time after the rank returned from it, it is the newest one a rank is inside.
    """
    groups: dict[str, dict[int, Position]] = {}
    for rank, positions in answers.items():
        for pos in positions:
            groups.setdefault(pos.pg, {})[rank] = pos
    found = []
    for _, by_rank in sorted(groups.items(), key=lambda g: (g[0].split(":")[0] != "nccl", g[0])):
        if not any(p.inside for p in by_rank.values()):
            continue
        if next(iter(by_rank.values())).backend == "nccl":
            seq = min(p.completed for p in by_rank.values()) + 1
        else:
            seq = max(p.enqueued for p in by_rank.values() if p.inside)
        waiting = sorted(r for r, p in by_rank.items() if p.enqueued >= seq)
        ops, states = {}, {}
        for r in waiting:
            pending = by_rank[r].at(seq)
            if pending is not None:
                ops[r] = (pending.op, pending.size)
                states[r] = pending.state
        utils = {r: p.gpu_util for r, p in by_rank.items() if p.gpu_util is not None}
        backend = next(iter(by_rank.values())).backend
        named = [op for op, _ in ops.values()]
        op = named[0] if named else "a collective"
        behind = {r: p.enqueued for r, p in sorted(by_rank.items()) if p.enqueued < seq}
        found.append(InFlight(op, seq, waiting, behind, ops, backend, states, utils))
    return found


def _mismatched(flight: InFlight) -> bool:
    return len(set(flight.ops.values())) > 1


def culprits_of(answers: dict[int, list[Position]]) -> list[int] | None:
    """The ranks that keep the others waiting, by the record; None when it cannot tell.

    A rank that never issued the stuck collective of a group its peers entered is a
    culprit; so is every rank of a mismatched collective (different ops or sizes at
    the same number). A rank that only waits in a collective, or ran ahead of it, is
    never one. On NCCL, where a waiting rank spins and /proc cannot tell it from a
    working one, the record decides alone (:func:`_on_device`): a rank whose device
    never started the collective its peers' devices run, else a rank whose GPU idles
    while its peers' are busy; else every rank in it (the collective itself is stuck).
    """
    found: set[int] = set()
    for flight in in_flight(answers):
        if _mismatched(flight):
            found.update(flight.ops)
        found.update(flight.behind)
        if not found and flight.backend == "nccl":
            found.update(_on_device(flight))
    return sorted(found) if found else None


_IDLE_UTIL = 30.0  # a GPU under this percent idles...
_BUSY_UTIL = 90.0  # ...while its peers', over this, spin in the collective


def _on_device(flight: InFlight) -> list[int]:
    """Of NCCL ranks that all issued the stuck collective: those whose device holds it up."""
    states = flight.states or {}
    started = [r for r in flight.inside if states.get(r) == "started"]
    if started:  # timing on: the devices that began it wait for the others
        late = [r for r in flight.inside if states.get(r) == "scheduled"]
        if late:
            return late
    utils = flight.utils or {}
    if all(r in utils for r in flight.inside):
        idle = [r for r in flight.inside if utils[r] < _IDLE_UTIL]
        busy = [r for r in flight.inside if utils[r] >= _BUSY_UTIL]
        if idle and busy:
            return idle
    return list(flight.inside)


def stood_still(earlier: dict[int, list[Position]], later: dict[int, list[Position]]) -> bool:
    """Two answers show every rank at the same place in its collectives."""

    def places(answers: dict[int, list[Position]]) -> dict[int, list[tuple[Any, ...]]]:
        return {r: sorted(p._replace(gpu_util=None) for p in ps) for r, ps in answers.items()}

    return bool(later) and places(earlier) == places(later)


def describe(answers: dict[int, list[Position]], culprits: list[int], world_size: int) -> list[str]:
    """Lines naming the collective the waiting ranks are in and who never entered it.

    Args:
        answers: ``rank -> positions`` of the ranks that answered.
        culprits: The flagged ranks.
        world_size: Ranks in the group.

    Returns:
        One line per process group with a collective in flight, e.g.
        ``ranks 0, 2, 3 wait in all_reduce #1812, which rank 1 never entered
        (last entered: rank 1: #1811)``; empty when no rank answered or none is
        in one.
    """
    lines = []
    silent = sorted(r for r in range(world_size) if r not in answers and r in culprits)
    for flight in in_flight(answers):
        if _mismatched(flight):
            first = next(iter(flight.ops.values()))[1]
            each = ", ".join(
                f"rank {r} {'is in' if i == 0 else 'in'} {op} #{flight.seq}"
                + (_size_text(size) if i == 0 or size != first else "")
                for i, (r, (op, size)) in enumerate(flight.ops.items())
            )
            line = f"{each}: a mismatched collective"
        else:
            verb = "waits" if len(flight.inside) == 1 else "wait"
            line = f"{_ranks('rank', flight.inside)} {verb} in {flight.op} #{flight.seq}"
        parts = []
        if flight.behind:
            lasts = ", ".join(f"rank {r}: #{last}" for r, last in flight.behind.items())
            parts.append(
                f"which {_ranks('rank', list(flight.behind))} never entered (last entered: {lasts})"
            )
        elif flight.backend == "nccl" and not _mismatched(flight):
            held = _on_device(flight)
            if len(held) < len(flight.inside):
                utils = flight.utils or {}
                why = (
                    "whose GPU never started it"
                    if any((flight.states or {}).get(r) == "scheduled" for r in held)
                    and any((flight.states or {}).get(r) == "started" for r in flight.inside)
                    else "whose GPU idles ("
                    + ", ".join(f"rank {r}: {utils[r]:.0f} %" for r in flight.inside if r in utils)
                    + ")"
                )
                parts.append(f"held up by {_ranks('rank', held)}, {why}")
        if silent:
            parts.append(
                f"{_ranks('rank', silent)} could not answer (stopped?), so "
                f"{'it is' if len(silent) == 1 else 'they are'} not known to be in it"
            )
        lines.append(line + (", " + "; ".join(parts) if parts else ""))
    return lines


def _size_text(size: int | None) -> str:
    if size is None:
        return ""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f" ({size / scale:.3g} {unit})"
    return f" ({size} B)"


def _ranks(word: str, ranks: list[int]) -> str:
    listed = ", ".join(str(r) for r in ranks)
    return f"{word} {listed}" if len(ranks) == 1 else f"{word}s {listed}"
