"""The words of a hang: one text for the cell, culprits first, then every rank's stack.

A stack reads as a traceback does: each frame's file and line, then the
line's text, from the kernel's copy of the file. A frame of a notebook cell is
named as IPython names it ("Cell In[4], line 13"). Code sent by value runs in
the rank under the file name ``<dynamic-code>``; the launcher, which holds the
original code, renames those frames (the watchdog's ``localize``).
"""

from __future__ import annotations

import linecache
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from nbtools import events
from nbtools._hangs import _collectives, _process
from nbtools._hangs._state import Flag, RankState
from nbtools._internal.tracebacks import cell_label

__all__ = [
    "HangReport",
    "Culprit",
    "RankView",
    "hang_report",
    "report_hang",
    "clock_text",
    "as_traceback",
    "in_user_terms",
]

# A frame of a py-spy dump: "    train (/path/to/file.py:41)".
_SPY_FRAME = re.compile(r"^(\s+)(\S.*?) \((.+):(\d+)\)$")

_KEEPS_RUNNING = (
    "The call keeps running (on_hang='restart' restarts the group instead); "
    "every rank's Python stack follows."
)


class Culprit(NamedTuple):
    """One flagged rank."""

    rank: int
    node: str
    since: float  # when it last made progress (epoch seconds, by the kernel's clock)
    why: str = ""  # e.g. "made no progress for 50 s (since 12:04:05, after step 9; ...)"


class RankView(NamedTuple):
    """One rank as the report shows it."""

    host: str = ""
    pid: int = 0
    step: int | None = None
    sampled: tuple[str, str] | None = None  # (state, detail) from /proc
    stack: str | None = None  # None: the rank runs on another node


@dataclass(frozen=True)
class HangReport:
    """One hang, as the cell shows it.

    Attributes:
        culprits: The flagged ranks, with what was seen of each.
        headline: One paragraph: the culprits, who waits for them, where, for how long.
        stacks: ``rank -> Python stack text`` (or why there is none), every rank.
        text: The warning for the cell: the headline, then every rank's stack.
    """

    culprits: tuple[Culprit, ...]
    headline: str
    stacks: dict[int, str] = field(default_factory=dict)
    text: str = ""

    @property
    def ranks(self) -> tuple[int, ...]:
        """The culprits' ranks, lowest first."""
        return tuple(c.rank for c in self.culprits)

    @property
    def since(self) -> float:
        """When the earliest culprit last made progress (epoch seconds)."""
        return min((c.since for c in self.culprits), default=0.0)


def clock_text(epoch: float) -> str:
    """``12:04:05``: the local wall-clock time of an epoch time."""
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def as_traceback(stack: str) -> str:
    """A py-spy dump's frames written as a traceback's: file, line, name, then the line's text."""
    out = []
    for line in stack.splitlines():
        frame = _SPY_FRAME.match(line)
        if frame is None:
            out.append(line)
            continue
        indent, qualified, filename, number = frame.groups()
        # As a traceback names it: "train", not "f.<locals>.train".
        name = qualified.rsplit(".", 1)[-1]
        label = cell_label(filename)
        where = f"{label}, line {number}" if label else f'File "{filename}", line {number}'
        out.append(f"{indent}{where}, in {name}")
        # A pseudo-file ("<pool execute>") has lines only when its caller cached them.
        text = linecache.getline(filename, int(number))
        if text.strip():
            out.append(f"{indent}  {text.strip()}")
    return "\n".join(out)


def in_user_terms(stack: str, localize: Callable[[str], str] | None) -> str:
    """A py-spy dump as a traceback, with the launcher's names (``localize``) for code sent
    by value."""
    text = as_traceback(stack)
    if localize is not None:
        try:
            text = localize(text).rstrip("\n")
        except Exception:  # noqa: BLE001 - the report goes out with the rank's names
            return text
    return text


def hang_report(
    culprits: list[Culprit],
    ranks: dict[int, RankView],
    world_size: int,
    collectives: list[str] | None = None,
) -> HangReport:
    """Build the cell's text.

    Args:
        culprits: The flagged ranks, each with its reason.
        ranks: What was seen of each rank; its stack is None on another node.
        world_size: Ranks in the group.
        collectives: Lines naming the collective in flight and the ranks that
            never entered it (from torch's Flight Recorder), when the ranks said.
    """
    culprits = sorted(culprits)
    flagged = [c.rank for c in culprits]
    lines = [f"rank {c.rank} on {c.node or 'an unknown node'} {c.why}" for c in culprits]
    others = [r for r in range(world_size) if r not in flagged]
    headline = "hang: " + "; ".join(lines) + "."
    if others:
        pronoun = "it" if len(flagged) == 1 else "them"
        who = (
            f"Rank {others[0]} waits"
            if len(others) == 1
            else "Ranks " + ", ".join(str(r) for r in others) + " wait"
        )
        headline += f" {who} for {pronoun}."
    for line in collectives or []:
        headline += f" In torch's record of collectives: {line}."
    parts = [headline + " " + _KEEPS_RUNNING]
    stacks = {}
    for rank in range(world_size):
        view = ranks.get(rank, RankView())
        state = _process.describe_state(*view.sampled) if view.sampled else "state unknown"
        title = (
            f"--- rank {rank}"
            + (f" on {view.host}" if view.host else "")
            + (f", pid {view.pid}" if view.pid else "")
        )
        title += f", step {view.step}" if view.step is not None else ""
        title += f": {state}" + (" (flagged)" if rank in flagged else "") + " ---"
        stack = view.stack
        if stack is None:
            stack = (
                "(no stack: the rank never reported progress)"
                if not view.pid
                else "(no stack: the rank runs on another node)"
            )
        stacks[rank] = stack
        parts.append(title + "\n" + stack)
    return HangReport(tuple(culprits), headline, stacks, "\n".join(parts))


def report_hang(
    flags: list[Flag],
    ranks: dict[int, RankState],
    answers: dict[int, list[_collectives.Position]],
    now: float,
    epoch: Callable[[float], float],
    world_size: int,
    bounds: dict[int, float],
    localize: Callable[[str], str] | None,
) -> HangReport:
    """Emit one ``hang`` event per new flag and make the report for the cell.

    Args:
        flags: The new hang flags.
        ranks: Every rank known.
        answers: The ranks' positions in their collectives (may be empty).
        now: The kernel's time (monotonic).
        epoch: Turns a kernel time into an epoch time.
        world_size: Ranks in the group.
        bounds: Each rank's hang bound, in seconds.
        localize: The launcher's names for frames of code sent by value.
    """
    states = {r: (s.recent[-1] if s.recent else None) for r, s in ranks.items()}
    where = _collectives.describe(answers, [f.rank for f in flags], world_size)
    flying = _collectives.in_flight(answers)
    culprits = []
    for flag in flags:
        state = ranks.get(flag.rank)
        sampled = states.get(flag.rank)
        what = _process.describe_state(*sampled) if sampled else ""
        stalled = now - flag.since
        since = epoch(flag.since)
        after = (
            f", after step {state.step}"
            if state is not None and state.step is not None
            else ", before its first step"
        )
        why = (
            f"made no progress for {stalled:.0f} s (since {clock_text(since)}{after}"
            + (f"; {what}" if what else "")
            + ")"
        )
        culprits.append(Culprit(flag.rank, flag.node, since, why))
        # The collective in flight, and whether this rank is in it (None: unknown).
        collective, entered = None, None
        for flight in flying[:1]:
            collective = f"{flight.op} #{flight.seq}"
            entered = (
                True
                if flag.rank in flight.inside
                else False
                if flag.rank in flight.behind
                else None
            )
        events.emit(
            "hang",
            f"rank {flag.rank} on {flag.node or 'an unknown node'} {why}"
            + "".join(f"; {line}" for line in where),
            rank=flag.rank,
            node=flag.node,
            since=round(since, 3),
            stalled_s=round(stalled, 1),
            step=state.step if state is not None else None,
            rank_pid=state.pid if state is not None else None,
            bound_s=round(bounds.get(flag.rank, 0.0), 1),
            collective=collective,
            entered=entered,
        )
    local = {r: s.pid for r, s in ranks.items() if s.local and s.pid}
    stacks = {
        pid: in_user_terms(text, localize)
        for pid, text in _process.python_stacks(local.values()).items()
    }
    views = {
        r: RankView(s.host, s.pid, s.step, states.get(r), stacks.get(s.pid) if s.local else None)
        for r, s in ranks.items()
    }
    return hang_report(culprits, views, world_size, where)
