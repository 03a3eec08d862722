"""One rank as the watchdog knows it, and an open flag: the state its judgements read.

A :class:`RankState` holds what the kernel learned of one rank: its progress
reports (timed by when they reached the kernel, never by the rank's clock),
its sampled process states, CPU and I/O use, and its straggler score. A
:class:`Flag` is an open hang or straggler flag. The helpers here read a
state without judging the group: when the rank last showed progress, what it
does now, and the settings a watchdog is built from.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from nbtools._hangs import _process
from nbtools._internal import settings
from nbtools.events import _probe

__all__ = [
    "RECENT_SAMPLES",
    "RankState",
    "Flag",
    "last_sign",
    "now_state",
    "is_stopped",
    "stuck_outside",
    "setting",
    "lower_median",
    "is_busy",
    "FirstSteps",
    "sampled",
]

_BUSY_WINDOW_S = 10.0  # a rank is busy when, over this window, its process tree used...
_BUSY_CPU = 0.1  # ...this share of a core
_BUSY_IO = 1 << 20  # ...or read and wrote this many bytes
_MIN_BUSY_SPAN_S = 2.0  # measured since the rank stalled for at least this long

RECENT_SAMPLES = 20  # the state of a rank "now": the majority of its latest samples


@dataclass
class RankState:
    """One rank as the watchdog knows it: its progress, samples and score."""

    rank: int
    host: str = ""
    pid: int = 0
    local: bool = False
    tid: int = 0  # the thread that reports its steps, when not the main one (Ray's actors)
    step: int | None = None
    steps: int = 0
    # Kernel times (monotonic) of when reports arrived: never the rank's clock.
    progressed_at: float = 0.0  # a report with new steps
    alive_at: float = 0.0  # a report with a new mark that counted no step
    arrived_at: float = 0.0  # the latest report that showed progress of either kind
    streak_from: float = 0.0  # since when such reports came without a gap
    # The rank's own clock, only to measure its step times (a difference on one clock).
    stepped_at: float = 0.0  # its time of its latest step
    marked_at: float = 0.0  # its time of its latest mark that counted no step
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    bins: deque[tuple[float, int, int]] = field(default_factory=deque)
    working: int = 0
    waiting: int = 0
    recent: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))
    started_at: float = 0.0  # kernel time of its launch (a replacing process: its first report)
    phase: str | None = None  # the phase it named (events.phase), as its latest report said
    usage: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=64))
    long_since: float | None = None  # the start of the long phase the cell was told of
    device_outside: float | None = None  # share outside NCCL's collectives, as it reported
    probed_at: float = 0.0  # kernel time of its own probe's latest findings (another node)
    looked_at: float = 0.0  # kernel time of the latest look at it from its node (another node)
    score: float | None = None
    low_since: float | None = None
    high_since: float | None = None


@dataclass
class Flag:
    """An open hang or straggler flag."""

    kind: str
    rank: int
    node: str
    since: float  # kernel time (monotonic) of the rank's last progress, or of the low score
    score: float | None = None


def last_sign(state: RankState) -> float:
    """When the rank last showed progress: a step, or a mark (a batch) that counted none."""
    return max(state.progressed_at, state.alive_at)


def now_state(state: RankState) -> str | None:
    """The majority of a local rank's latest samples, or what a rank on another node said
    of itself (:meth:`nbtools.events._probe.Probe.take`); None when neither is known."""
    if not (state.local or state.probed_at) or not state.recent:
        return None
    counts: dict[str, int] = {}
    for kind, _ in state.recent:
        counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=counts.__getitem__)


def is_stopped(state: RankState) -> bool:
    """Stopped by a signal: no start-up, and a culprit whatever the others do."""
    return now_state(state) == _probe.STOPPED


def stuck_outside(ranks: list[RankState], busy: set[int] | None = None) -> list[RankState]:
    """Of ranks that all stopped: those stuck outside a collective, not those waiting
    (:func:`._process.stuck_by_state`); ``busy`` ranks count as outside."""
    now_states = {s.rank: now_state(s) for s in ranks}
    named = _process.stuck_by_state(now_states, {s.rank: s.steps for s in ranks}, busy or set())
    return [s for s in ranks if s.rank in named]


def setting(value: float | None, name: str, default: float) -> float:
    """``value``, else environment variable ``name`` (checked by the settings table), else
    ``default``."""
    if value is not None:
        return float(value)
    read = settings.read(name)
    return default if read is None else float(read)


def lower_median(values: list[float]) -> float:
    """The lower of the two middle values (the middle one of an odd count)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def is_busy(state: RankState, since: float) -> bool:
    """Since ``since`` (the rank's last progress, kernel time), and over the last few
    seconds, its process tree used the CPU or read and wrote; never a stopped rank."""
    if not state.usage or now_state(state) == _probe.STOPPED:
        return False
    since += 0.5  # a report arrives up to a second after its step
    end, cpu, io = state.usage[-1]
    first = None
    for sample in reversed(state.usage):
        if sample[0] < since or end - sample[0] > _BUSY_WINDOW_S:
            break
        first = sample
    if first is None or end - first[0] < _MIN_BUSY_SPAN_S:
        return False  # not measured for long enough since it stalled
    at, cpu0, io0 = first
    span = end - at
    return cpu - cpu0 >= _BUSY_CPU * span or io - io0 >= _BUSY_IO * span / _BUSY_WINDOW_S


class FirstSteps:
    """How long the ranks of one run took from their start to their first step.

    A launch keeps one across its attempts, and a pool across its calls: each
    attempt's or call's :class:`~nbtools._hangs.Watchdog` adds what its ranks
    show and learns its start-up bound from every first step seen so far, so a
    restarted group's first step is judged by what the earlier attempts showed,
    not by the default of a run that showed nothing yet. Thread-safe.
    """

    def __init__(self) -> None:
        self._seen: deque[float] = deque(maxlen=64)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        """A rank took ``seconds`` (kernel time) from its launch to its first step."""
        with self._lock:
            self._seen.append(max(0.0, float(seconds)))

    def slowest(self) -> float | None:
        """The slowest first step seen; None before any."""
        with self._lock:
            return max(self._seen, default=None)


def sampled(state: RankState) -> bool:
    """Whether the rank's training thread is sampled: by the kernel, or by its own probe."""
    return state.local or bool(state.probed_at)
