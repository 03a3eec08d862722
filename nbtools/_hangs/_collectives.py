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


class Position(NamedTuple):
    """Where one rank is in one process group, from its Flight Recorder."""

    pg: str
    enqueued: int  # the last collective issued
    completed: int  # the last one finished
    op: str | None  # the name of the last one recorded
    op_seq: int | None  # ... and its number
    size: int | None  # ... and its input's bytes, when recorded

    @property
    def inside(self) -> bool:
        """The rank entered a collective that has not completed."""
        return self.enqueued > self.completed

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Position:
        """From the fields of one ``collectives`` answer."""
        return cls(
            str(fields.get("pg")),
            int(fields.get("enqueued", -1)),
            int(fields.get("completed", -1)),
            fields.get("op"),
            fields.get("op_seq"),
            fields.get("bytes"),
        )


class InFlight(NamedTuple):
    """The collective in flight in one process group."""

    op: str  # its name ("a collective" when no rank in it recorded one)
    seq: int  # its number
    inside: list[int]  # the ranks in it
    behind: dict[int, int]  # rank -> the last it entered, for ranks that never entered it
    ops: dict[int, tuple[str, int | None]]  # rank -> (op, bytes) of each rank in it, recorded


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
    """The collective in flight in each process group where some rank is inside one."""
    groups: dict[str, dict[int, Position]] = {}
    for rank, positions in answers.items():
        for pos in positions:
            groups.setdefault(pos.pg, {})[rank] = pos
    found = []
    for _, by_rank in sorted(groups.items()):
        inside = {r: p for r, p in by_rank.items() if p.inside}
        if not inside:
            continue
        seq = max(p.enqueued for p in inside.values())
        waiting = sorted(r for r, p in inside.items() if p.enqueued == seq)
        ops = {
            r: (p.op, p.size)
            for r, p in sorted(inside.items())
            if p.enqueued == seq and p.op_seq == seq and p.op is not None
        }
        named = [op for op, _ in ops.values()]
        op = named[0] if named else "a collective"
        behind = {r: p.enqueued for r, p in sorted(by_rank.items()) if p.enqueued < seq}
        found.append(InFlight(op, seq, waiting, behind, ops))
    return found


def _mismatched(flight: InFlight) -> bool:
    return len(set(flight.ops.values())) > 1


def culprits_of(answers: dict[int, list[Position]]) -> list[int] | None:
    """The ranks that keep the others waiting, by the record; None when it cannot tell.

    A rank behind a collective its peers entered is a culprit; so is every rank
    of a mismatched collective (different ops or sizes at the same number). A
    rank that only waits in a collective is never one.
    """
    found: set[int] = set()
    for flight in in_flight(answers):
        if _mismatched(flight):
            found.update(flight.ops)
        found.update(flight.behind)
    return sorted(found) if found else None


def stood_still(earlier: dict[int, list[Position]], later: dict[int, list[Position]]) -> bool:
    """Two answers show every rank at the same place in its collectives."""
    return bool(later) and {r: sorted(p) for r, p in earlier.items()} == {
        r: sorted(p) for r, p in later.items()
    }


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
