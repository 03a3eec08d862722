"""The words of a hang: one text for the cell, culprits first, then every rank's stack."""

from __future__ import annotations

import time
from dataclasses import dataclass

from nbtools.events import _procstate

__all__ = ["HangReport", "hang_report", "clock_text"]


@dataclass(frozen=True)
class HangReport:
    """One hang, as the cell shows it.

    Attributes:
        ranks: The culprits: ranks that made no progress while others waited.
        since: When the earliest of them last made progress (epoch seconds).
        text: The warning: culprits, where, for how long, then every rank's stack.
    """

    ranks: tuple[int, ...]
    since: float
    text: str


def clock_text(epoch: float) -> str:
    """``12:04:05``: the local wall-clock time of an epoch time."""
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def hang_report(
    flags: list[tuple[int, str, float]],
    ranks: dict[int, tuple[str, int, int | None, tuple[str, str] | None, str | None]],
    world_size: int,
    now: float,
    collectives: list[str] | None = None,
) -> HangReport:
    """Build the cell's text.

    Args:
        flags: ``(rank, node, since)`` of each culprit.
        ranks: ``rank -> (host, pid, last step, sampled (state, detail), stack text)``;
            the stack is None for a rank on another node.
        world_size: Ranks in the group.
        now: Epoch seconds now.
        collectives: Lines naming the collective in flight and the ranks that
            never entered it (from torch's Flight Recorder), when the ranks said.
    """
    culprits = sorted(rank for rank, _, _ in flags)
    since = min(s for _, _, s in flags)
    lines = []
    for rank, node, at in sorted(flags):
        host, _, step, sampled, _ = ranks.get(rank, ("", 0, None, None, None))
        where = node or host or "an unknown node"
        what = f"; {_procstate.describe_state(*sampled)}" if sampled else ""
        after = f", after step {step}" if step is not None else ", before its first step"
        lines.append(
            f"rank {rank} on {where} made no progress for {now - at:.0f} s "
            f"(since {clock_text(at)}{after}{what})"
        )
    others = [r for r in range(world_size) if r not in culprits]
    head = "hang: " + "; ".join(lines) + "."
    if others:
        head += f" Ranks {_ranks_text(others)} wait for {'it' if len(culprits) == 1 else 'them'}."
    for line in collectives or []:
        head += f" In torch's record of collectives: {line}."
    head += (
        " The call keeps running (on_hang='restart' restarts the group instead); "
        "every rank's Python stack follows."
    )
    parts = [head]
    for rank in range(world_size):
        host, pid, step, sampled, stack = ranks.get(rank, ("", 0, None, None, None))
        state = _procstate.describe_state(*sampled) if sampled else "state unknown"
        title = (
            f"--- rank {rank}" + (f" on {host}" if host else "") + (f", pid {pid}" if pid else "")
        )
        title += f", step {step}" if step is not None else ""
        title += f": {state}" + (" (flagged)" if rank in culprits else "") + " ---"
        if stack is None:
            stack = (
                "(no stack: the rank never reported progress)"
                if not pid
                else "(no stack: the rank runs on another node)"
            )
        parts.append(title + "\n" + stack)
    return HangReport(tuple(culprits), since, "\n".join(parts))


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
