"""What the watchdog keeps per rank and per flag, and its small helpers."""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field

from nbtools.events import _procstate

__all__ = [
    "RankState",
    "Flag",
    "now_state",
    "stuck_outside",
    "last_sign",
    "setting",
    "lower_median",
    "RECENT_SAMPLES",
]

RECENT_SAMPLES = 20  # the state of a rank "now": the majority of its latest samples


@dataclass
class RankState:
    """One rank as the watchdog knows it: its progress, samples and score."""

    rank: int
    host: str = ""
    pid: int = 0
    local: bool = False
    step: int | None = None
    steps: int = 0
    progressed_at: float = 0.0  # rank's time of its latest step
    alive_at: float = 0.0  # rank's time of its latest mark that counted no step
    arrived_at: float = 0.0  # kernel time of the latest report
    streak_from: float = 0.0  # kernel time since which reports came without a gap
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    bins: deque[tuple[float, int, int]] = field(default_factory=deque)
    working: int = 0
    waiting: int = 0
    recent: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))
    score: float | None = None
    low_since: float | None = None
    high_since: float | None = None


@dataclass
class Flag:
    """An open hang or straggler flag."""

    kind: str
    rank: int
    node: str
    since: float
    score: float | None = None


def last_sign(state: RankState) -> float:
    """When the rank last showed progress: a step, or a mark (a batch) that counted none."""
    return max(state.progressed_at, state.alive_at)


def now_state(state: RankState) -> str | None:
    """The majority of a local rank's latest samples; None when it cannot be sampled."""
    if not state.local or not state.recent:
        return None
    counts: dict[str, int] = {}
    for kind, _ in state.recent:
        counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=counts.__getitem__)


def stuck_outside(ranks: list[RankState]) -> list[RankState]:
    """Of ranks that all stopped: those stuck outside a collective, not those waiting."""
    now_states = {s.rank: now_state(s) for s in ranks}
    waiting = [s for s in ranks if now_states[s.rank] == _procstate.WAITING]
    outside = [s for s in ranks if now_states[s.rank] in (_procstate.WORKING, _procstate.STOPPED)]
    stopped = [s for s in ranks if now_states[s.rank] == _procstate.STOPPED]
    unknown = [s for s in ranks if now_states[s.rank] is None]
    most = max(s.steps for s in ranks)
    lagging = [s for s in ranks if s.steps < most]
    if waiting and outside:
        return outside
    if stopped:
        return stopped
    if unknown and lagging:
        return lagging  # ranks elsewhere: the one behind is the likely culprit
    if unknown and not outside:
        return ranks  # nothing tells them apart: every rank stalled
    if waiting and not outside:
        return ranks  # every rank waits: the collective itself is stuck
    return []  # every rank is computing (an evaluation, a compile): not a hang


def setting(value: float | None, name: str, default: float) -> float:
    """``value``, else the number in environment variable ``name``, else ``default``."""
    if value is not None:
        return float(value)
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive number, got {text!r}")
    return number


def lower_median(values: list[float]) -> float:
    """The lower of the two middle values (the middle one of an odd count)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]
