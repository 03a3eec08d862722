"""The kernel's watch over a running group: hangs and stragglers, as events.

A :class:`Watchdog` reads the ranks' ``progress`` reports from the bus
(:mod:`nbtools.events._progress`) and, on a thread of its own, samples each
local rank's training thread from outside (:mod:`nbtools.events._probe`). It
never runs on a rank and costs the training thread nothing. Every time it
judges by is the kernel's own (monotonic, from when each report arrived):
never a rank's clock, which may be off by any amount.

Hangs. A rank is hung when it made no progress for longer than its bound
while others made progress, or while every rank stopped and the others wait
in a collective for it. The bound is ``hang_timeout`` when given, else ten
median step times and at least 45 s; before a rank's first step it is the
start-up bound (counted from when the kernel launched the rank, on its own clock:
the process start, imports, a restore, a cold compile): ``startup_timeout`` (or ``NBTOOLS_STARTUP_TIMEOUT_S``) when given,
else three times the slowest first step a rank of the run reported (in this
attempt or an earlier one, or a pool's earlier call: :class:`FirstSteps`), and 3
minutes before any did; in a phase the rank named (``events.phase``) it is the
long bound. When every rank stalls, the ranks are asked twice where they are
in their collectives before the bound (:data:`LOOK_AHEAD_S` and a tick before
it), so that a hang is named at the bound. Only culprits are flagged,
never a rank that only waits: torch's Flight Recorder says which ranks are
inside the collective in flight (:mod:`._collectives`), and a rank behind it,
or in a different collective at the same number (a mismatch), is the
culprit. Without an answer, /proc decides: a stopped rank, or one outside any
collective while others wait in one; never on NCCL ranks, whose wait is a spin
that /proc reads as work (there the record decides, see :mod:`._collectives`).

Busy is not stuck. A culprit whose process tree still uses the CPU or reads
and writes (an evaluation on one rank, a save waiting for its own threads, a
compile waiting for its workers) is in a long phase: one line for the cell,
"rank 0 on node-a is in a long phase outside collectives (busy 70 s)", and a
``long_phase`` event. It is named as hung only once it stops using the CPU,
or past the long bound (``phase_timeout``: 15 minutes, or ten hang bounds).
When every rank computes nobody is flagged.

Stragglers are scored by :mod:`._stragglers` from the samples taken here:
samples taken while no rank makes progress (evaluation, restore) or around a
checkpoint save are left out, so pauses every rank shares raise no flag.

Every flag is a ``hang`` or ``straggler`` event with ``rank``, ``node``,
``since`` (and ``score``), and the same kind with ``ended=True`` when it is
over. A hang also becomes a :class:`HangReport`: one text with the culprits
and every rank's Python stack, for the cell; a straggler flag's start and end
are one line each for the cell (:meth:`Watchdog.take_notices`), worded as what
was measured.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from nbtools import events
from nbtools._hangs import _collectives
from nbtools._hangs._flags import FlagBook
from nbtools._hangs._report import (
    HangReport,
    report_hang,
)
from nbtools._hangs._state import (
    FirstSteps,
    Flag,
    RankState,
    is_busy,
    is_stopped,
    last_sign,
    now_state,
    setting,
    stuck_outside,
)
from nbtools._hangs._stragglers import Stragglers
from nbtools._internal import settings
from nbtools._internal.log import get_logger
from nbtools.events import _probe

__all__ = ["Watchdog", "RankState", "Flag", "MIN_HANG_S", "HANG_STEPS", "THRESHOLD"]

_log = get_logger("events")

#: The adaptive hang bound is never shorter than this: long enough for a first step
#: that compiles for half a minute, short enough to name a stopped rank within a minute.
MIN_HANG_S = 45.0
#: ... and otherwise this many median step times.
HANG_STEPS = 10.0
#: Scores under this flag a straggler.
THRESHOLD = 0.75
#: Before its first step a rank has this long (from its launch) when not told otherwise,
#: until the group shows how long a first step takes...
STARTUP_S = 180.0
#: ...then this many times the slowest first step seen (at least the hang bound).
STARTUP_STEPS = 3.0
#: A rank busy outside collectives, or in a phase it named, is hung only past this.
LONG_PHASE_S = 900.0
_ANSWERS_FRESH_S = 10.0  # the ranks' answers about their collectives count this long
#: The first of the two looks at the ranks' collectives that confirm a hang comes this
#: long before the bound (a third of the bound when that is shorter), the second one
#: tick before it: the hang is named at the bound, not a look after it.
LOOK_AHEAD_S = 10.0
_TICK_S = 1.0  # the watchdog judges the ranks this often (and at the bound)
_SILENT_S = 5.0  # a rank on another node whose probe has not reported for this long
_LOOK_AFTER_S = 2.0  # ...is looked at from its node (``look``) after this long
# Kinds whose time, around it, is left out of straggler scores.
_PAUSES = ("checkpoint_saved", "checkpoint_restored", "checkpoint_skipped", "restart")
_PAUSE_S = 5.0
_REPORT_GRACE_S = 2.5  # more than the time between two progress reports of a rank


class Watchdog:
    """Flags hung and straggling ranks of one group from their progress reports.

    Args:
        world_size: Ranks in the group (those that never report count as stalled).
        hang_timeout: Seconds without progress that make a hang; None: adaptive
            (ten median step times, at least :data:`MIN_HANG_S`, 45 s).
        threshold: Straggler scores under this are flagged (default 0.75, or
            ``NBTOOLS_STRAGGLER_THRESHOLD``).
        window_s: Seconds of samples a straggler score covers (default 30, or
            ``NBTOOLS_STRAGGLER_WINDOW_S``).
        confirm_s: How long a score must stay under (or back over) the threshold
            (default 10, or ``NBTOOLS_STRAGGLER_CONFIRM_S``).
        sample_s: Period of the /proc samples of local ranks.
        startup_timeout: Seconds a rank has, from its launch, to report its first
            step (at least ``hang_timeout``). None: ``NBTOOLS_STARTUP_TIMEOUT_S`` when
            set, else learned from the run, three
            times the slowest first step a rank of the group reported (at least the
            hang bound), and :data:`STARTUP_S` (3 minutes) before any did.
        phase_timeout: Seconds a rank busy outside collectives, or in a phase it
            named, has before it is hung (default :data:`LONG_PHASE_S`, 15 minutes,
            or ten hang bounds when that is longer).
        on_hang: Called with each :class:`HangReport`, on the watchdog's thread.
        localize: Rewrites a stack's frames of code sent by value (``<dynamic-code>``)
            with their original file and line; the launcher, which holds the code,
            passes it.
        first_steps: The first steps of the run's earlier attempts (restarts, a pool's
            earlier calls), which the start-up bound is learned from too; the launcher
            keeps one per run. None: this watch's own.
        bus: Where the reports come from and the flags go (this process's bus).
        clock: The kernel's monotonic clock (``time.monotonic``).
        launched_at: When the kernel launched the ranks, on ``clock``; the start-up
            bound counts from it. None: now (the watch starts with the ranks).
        look: Looks at a rank on another machine from its own node,
            ``look(rank, tid) -> (CPU s, I/O bytes, state, detail) | None``, never
            blocking (the Ray launcher's :meth:`RayGroup.look_at`): asked once a tick
            for a rank whose own reports stopped (a training thread that holds the GIL
            starves the rank's probe), so that busy is still told from stuck.

    Example:
        >>> dog = Watchdog(world_size=4).start()
        >>> # the group runs; hang and straggler events appear on the bus
        >>> dog.stop()
    """

    def __init__(
        self,
        world_size: int,
        *,
        hang_timeout: float | None = None,
        threshold: float | None = None,
        window_s: float | None = None,
        confirm_s: float | None = None,
        sample_s: float = 0.1,
        startup_timeout: float | None = None,
        phase_timeout: float | None = None,
        on_hang: Callable[[HangReport], Any] | None = None,
        localize: Callable[[str], str] | None = None,
        first_steps: FirstSteps | None = None,
        bus: events.Bus | None = None,
        clock: Callable[[], float] = time.monotonic,
        launched_at: float | None = None,
        look: Callable[[int, int], tuple[float, int, str, str] | None] | None = None,
    ) -> None:
        threshold = setting(threshold, "NBTOOLS_STRAGGLER_THRESHOLD", THRESHOLD)
        window_s = setting(window_s, "NBTOOLS_STRAGGLER_WINDOW_S", 30.0)
        confirm_s = setting(confirm_s, "NBTOOLS_STRAGGLER_CONFIRM_S", 10.0)
        if not 0 < threshold < 1:
            raise ValueError(f"the straggler threshold must be between 0 and 1, got {threshold!r}")
        self.world_size = world_size
        self.hang_timeout = hang_timeout
        self.threshold = threshold
        self.window_s = window_s
        self.confirm_s = confirm_s
        self.sample_s = sample_s
        if startup_timeout is None:
            startup_timeout = settings.read("NBTOOLS_STARTUP_TIMEOUT_S")
        self.startup_timeout = STARTUP_S if startup_timeout is None else float(startup_timeout)
        self._learn_startup = startup_timeout is None
        # Seconds from each rank's start to its first step, in this run's attempts so far.
        self._first_steps = first_steps if first_steps is not None else FirstSteps()
        self.phase_timeout = phase_timeout
        self._on_hang = on_hang
        self._localize = localize
        self._look = look
        self._looked: set[int] = set()  # ranks on other machines looked at once already
        self._clock = clock
        self._bus = bus if bus is not None else events.bus()
        self._ranks: dict[int, RankState] = {}
        self._book = FlagBook(clock)
        self._flags = self._book.open
        self._stragglers = Stragglers(self._book, threshold, window_s, confirm_s, sample_s)
        self._reports: list[HangReport] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The launch: the start-up bound of the ranks launched with the group counts from here.
        self._started_at = clock() if launched_at is None else float(launched_at)
        self._answers: dict[int, list[_collectives.Position]] = {}
        self._answered_at = -1e9
        self._earlier: dict[int, list[_collectives.Position]] = {}  # the answers before
        self._earlier_at = -1e9
        self._due = float("inf")  # when every rank reaches its bound, once both looks came
        self._paused_from = 0.0
        self._paused_until = 0.0
        self._host = socket.gethostname()

    # --- life ------------------------------------------------------------------------

    def start(self) -> Watchdog:
        """Listen to the bus and start sampling; returns self."""
        self._bus.subscribe(self._on_events)
        try:
            self._thread = threading.Thread(target=self._loop, name="nbtools-watchdog", daemon=True)
            self._thread.start()
        except BaseException:
            # An interrupt can land while the thread starts (start() waits for it):
            # "with" never calls __exit__ then, so undo the start here.
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop watching; flags still open end (the group is over)."""
        self._bus.unsubscribe(self._on_events)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10.0)
        with self._lock:
            open_flags = list(self._flags.values())
            self._flags.clear()
        now = self._clock()
        with self._lock:
            for flag in open_flags:
                self._book.end(flag, now, "the group ended")
        self._send_posted()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what others read ----------------------------------------------------------------

    def take_reports(self) -> list[HangReport]:
        """The hang reports made since the last call (for the cell)."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def take_notices(self) -> list[str]:
        """The lines for the cell since the last call: a straggler flag starts or ends."""
        with self._lock:
            return self._book.take_notices()

    @property
    def reporting(self) -> bool:
        """True once any rank reported a step: hangs are judged by progress, not output."""
        return any(s.steps for s in self._ranks.values())

    def know(self, rank: int, pid: int, host: str) -> None:
        """The launcher knows rank ``rank``'s process before it reports (a pool's kept
        ranks): it is sampled from now on, so a rank stopped before its first report of
        the call is named within the hang bound. Its reports replace what is known."""
        with self._lock:
            if rank in self._ranks:
                return
            local = host.split(events.NODE_SEPARATOR, 1)[0] == self._host
            state = RankState(rank, host, pid, local)
            state.started_at = self._clock()
            self._ranks[rank] = state

    def flags(self) -> list[Flag]:
        """The open flags (copies)."""
        with self._lock:
            return [dataclasses.replace(f) for f in self._flags.values()]

    def bound(self) -> float:
        """Seconds without progress that make a hang now."""
        if self.hang_timeout is not None:
            return float(self.hang_timeout)
        median = self._median_step()
        return MIN_HANG_S if median is None else max(MIN_HANG_S, HANG_STEPS * median)

    def long_bound(self) -> float:
        """Seconds a rank busy outside collectives, or in a phase it named, has now."""
        if self.phase_timeout is not None:
            return float(self.phase_timeout)
        return max(LONG_PHASE_S, 10 * self.bound())

    def _bound_of(self, state: RankState) -> float:
        if state.phase is not None:
            return self.long_bound()
        if not state.steps and not is_stopped(state):
            return self.startup_bound()
        return self.bound()

    def startup_bound(self) -> float:
        """Seconds a rank has, from its launch, to report its first step now."""
        slowest = self._first_steps.slowest() if self._learn_startup else None
        if slowest is not None:
            return max(self.bound(), STARTUP_STEPS * slowest)
        return max(self.startup_timeout, self.hang_timeout or 0.0)

    def _since(self, state: RankState) -> float:
        """Kernel time of the rank's last sign of progress, else of its start."""
        return last_sign(state) or state.started_at or self._started_at

    # --- input -----------------------------------------------------------------------

    def _on_events(self, batch: list[events.Event]) -> None:
        with self._lock:
            for event in batch:
                if event.kind == events.PROGRESS_KIND and event.rank is not None:
                    self._progress(event)
                elif event.kind in _PAUSES:
                    now = self._clock()
                    start = now - _PAUSE_S
                    if now > self._paused_until:  # a new pause, not more of the last one
                        self._paused_from = start
                    self._paused_from = min(self._paused_from, start)
                    self._paused_until = max(self._paused_until, now + 2.0)

    def _progress(self, event: events.Event) -> None:
        known = self._ranks.get(event.rank)  # type: ignore[arg-type]
        new = known is None or known.pid != event.pid
        state = known
        if state is None or new:
            # Its process can be read here when it runs on this machine.
            local = event.host.split(events.NODE_SEPARATOR, 1)[0] == self._host
            state = RankState(event.rank, event.host, event.pid, local)  # type: ignore[arg-type]
            # Launched with the group: from the launch; a process that replaced the rank's
            # (a healed rank): from its first report, the kernel's first sign of its start.
            state.started_at = self._started_at if known is None else self._clock()
            self._ranks[event.rank] = state  # type: ignore[index]
        tid = event.fields.get("tid")
        state.tid = tid if type(tid) is int else 0
        if not state.local:  # what the rank saw of itself: the kernel cannot look
            self._probed(state, event.fields)
        outside = event.fields.get("outside")
        if isinstance(outside, (int, float)) and 0 <= outside <= 1:
            state.device_outside = float(outside)
        steps = event.fields.get("steps")
        if type(steps) is not int:
            return
        # A mark that counted no step (a batch of an evaluation loop, once the rank
        # reports numbered steps), or a phase that opened or closed: the rank is alive,
        # its step times are unchanged.
        alive = event.fields.get("alive")
        phase = event.fields.get("phase")
        phase = phase if isinstance(phase, str) else None
        marked = phase != state.phase
        state.phase = phase
        if isinstance(alive, (int, float)) and alive > state.marked_at:
            state.marked_at, marked = float(alive), True
        if steps <= state.steps:
            if marked:
                state.alive_at = self._arrived(state)
            return
        state.progressed_at = self._arrived(state)
        if not state.steps:  # its first step: how long a start takes in this group
            self._first_steps.add(state.progressed_at - state.started_at)
        if marked:
            state.alive_at = state.progressed_at
        if state.steps and event.time > state.stepped_at:
            state.step_times.append((event.time - state.stepped_at) / (steps - state.steps))
        state.steps, state.step, state.stepped_at = steps, event.step, event.time

    def _probed(self, state: RankState, fields: dict[str, Any]) -> None:
        """Take in a rank's own look at its training thread (``events._probe``)."""
        working, waiting = fields.get("working"), fields.get("waiting")
        if type(working) is not int or type(waiting) is not int:
            return  # a rank that does not sample itself
        state.probed_at = self._clock()
        state.working += working
        state.waiting += waiting
        kind, detail = fields.get("state"), fields.get("detail")
        if kind in (_probe.WORKING, _probe.WAITING, _probe.STOPPED):
            state.recent.clear()  # its own majority of its latest samples
            state.recent.append((kind, detail if isinstance(detail, str) else kind))
        cpu, io = fields.get("tree_cpu"), fields.get("tree_io")
        if isinstance(cpu, (int, float)) and type(io) is int:
            state.usage.append((state.probed_at, float(cpu), io))

    def _arrived(self, state: RankState) -> float:
        """A report that shows progress arrived now; returns now."""
        arrived = self._clock()
        if not state.arrived_at or arrived - state.arrived_at > _REPORT_GRACE_S:
            state.streak_from = arrived  # reports resume after a gap: a new streak
        state.arrived_at = arrived
        return arrived

    def _ask_collectives(self) -> dict[int, list[_collectives.Position]]:
        """Ask the ranks which collective they are in: ``rank -> positions``.

        The wait is for every rank that may answer: those on other machines too
        (Ray ranks, asked through their actors), not the local ones seen stopped.
        """
        with self._lock:
            expected = {
                r
                for r, s in self._ranks.items()
                if not s.local or now_state(s) not in (_probe.STOPPED, _probe.GONE)
            }
            pids = {r: s.pid for r, s in self._ranks.items()}
        return _collectives.ask(expected, pids, self._stop)

    # --- the thread --------------------------------------------------------------------

    def _loop(self) -> None:
        next_eval = self._clock() + _TICK_S
        while not self._stop.wait(self.sample_s):
            self._sample()
            if self._clock() >= min(next_eval, self._due):
                next_eval = self._clock() + _TICK_S
                try:
                    self._evaluate(self._clock())
                except Exception:  # noqa: BLE001 - the watch must outlive a bad tick
                    _log.exception("judging the ranks' progress failed; trying again")

    def _sample(self) -> None:
        with self._lock:
            now = self._clock()
            for state in self._ranks.values():
                if (
                    not state.local
                    and state.probed_at
                    and now - max(state.probed_at, state.looked_at) > _SILENT_S
                ):
                    # Its probe reports every second: what it said last is no longer
                    # known to hold (a stopped rank, or one starved of CPU or the GIL).
                    state.recent.clear()
            local = [(s, s.pid, s.tid) for s in self._ranks.values() if s.local]
        for state, pid, tid in local:
            kind, detail = _probe.sample(pid, tid)
            state.recent.append((kind, detail))
            if kind == _probe.WAITING:
                state.waiting += 1
            elif kind != _probe.GONE:
                state.working += 1

    def _evaluate(self, now: float) -> None:
        self._measure(now)
        with self._lock:
            self._bin(now)
            asking = self._needs_answers(now)
        if asking:
            answers = self._ask_collectives()
            with self._lock:
                self._earlier, self._earlier_at = self._answers, self._answered_at
                self._answers, self._answered_at = answers, self._clock()
        # The ranks' answers may come after the bound (a second look a tick before it,
        # on a loaded machine): judged as of when they came, not a tick later.
        judged = max(now, self._answered_at) if asking else now
        with self._lock:
            new_hangs = self._judge_hangs(judged)
            later = self._clock()
            edge = self._edge() if self._confirmed(later) else float("inf")
            self._due = edge if edge > later else float("inf")
            # A GPU rank's share covers its whole window: none right after a pause.
            settled = now - self._paused_until > self.window_s
            self._stragglers.judge(self._ranks, now, device=settled)
        self._send_posted()
        if new_hangs:
            self._report(new_hangs, judged)

    def _measure(self, now: float) -> None:
        """Read each local rank's process tree's CPU time and I/O (once a tick), and have
        a rank on another machine whose probe fell silent looked at from its node."""
        with self._lock:
            local = [(s, s.pid) for s in self._ranks.values() if s.local and s.pid]
            remote = [s for s in self._ranks.values() if not s.local and s.probed_at]
            silent = [s for s in remote if now - s.probed_at > _LOOK_AFTER_S]
            # A first look at each, so that its node is ready to look when it falls silent.
            first = [s for s in remote if s.rank not in self._looked and s not in silent]
            self._looked.update(s.rank for s in remote)
        read = [(state, _probe.usage(pid)) for state, pid in local]
        looked = []
        if self._look is not None:
            for state in first:
                self._look(state.rank, state.tid)
            looked = [(state, self._look(state.rank, state.tid)) for state in silent]
        with self._lock:
            for state, used in read:
                if used is not None:
                    state.usage.append((now, *used))
            for state, seen in looked:
                if seen is not None and now - state.probed_at > _LOOK_AFTER_S:
                    cpu, io, kind, detail = seen
                    state.usage.append((now, cpu, io))
                    state.recent.clear()
                    state.recent.append((kind, detail))
                    state.looked_at = now

    def _busy(self, state: RankState) -> bool:
        return is_busy(state, self._since(state))

    # --- hangs -----------------------------------------------------------------------

    def _median_step(self) -> float | None:
        medians = [statistics.median(s.step_times) for s in self._ranks.values() if s.step_times]
        return statistics.median(medians) if medians else None

    def _world(self) -> dict[int, RankState]:
        """Every rank of the group: those never heard of as a placeholder."""
        ranks = {r: self._ranks.get(r) or RankState(r) for r in range(self.world_size)}
        ranks.update(self._ranks)
        return ranks

    def _stalled(self, now: float) -> list[RankState]:
        return [s for s in self._world().values() if now - self._since(s) > self._bound_of(s)]

    def _edge(self) -> float:
        """Kernel time at which every rank will have gone its bound without progress."""
        return max(self._since(s) + self._bound_of(s) for s in self._world().values())

    def _lead(self) -> float:
        """How long before the bound the first look at the collectives comes."""
        return min(LOOK_AHEAD_S, min(self._bound_of(s) for s in self._world().values()) / 3)

    def _needs_answers(self, now: float) -> bool:
        """Every rank stalled, or about to, and one not yet flagged: ask the ranks where
        they are. Two looks before the bound: the first :meth:`_lead` before it, the
        second a tick before it, so that the judgement at the bound has both."""
        if not self._ranks:
            return False
        edge, lead = self._edge(), self._lead()
        if now < edge - lead:
            return False
        if all(("hang", r) in self._flags for r in self._world()):
            return False
        if not self._fresh(now):
            return True
        # Fresh answers: ask again once, at the edge, unless both looks are in this stall.
        second = now >= edge - _TICK_S and now - self._answered_at >= lead / 2
        return second and not self._confirmed(now)

    def _confirmed(self, now: float) -> bool:
        """Two looks since the last progress of any rank, the latest fresh."""
        if not self._fresh(now):
            return False
        latest = max((last_sign(s) for s in self._ranks.values()), default=0.0)
        return self._earlier_at >= latest and self._answered_at > self._earlier_at

    def _judge_hangs(self, now: float) -> list[Flag]:
        if not self._ranks:
            return []
        for state in self._ranks.values():  # progress again: the flag ends
            flag = self._flags.get(("hang", state.rank))
            sign = last_sign(state)
            # A report that left before the stall and arrived late (its sender was
            # stopped too) is no progress: the rank must be back within the bound.
            if flag is not None and sign > flag.since and now - sign <= self._bound_of(state):
                del self._flags[("hang", state.rank)]
                self._book.end(flag, now, f"made progress again (step {state.step})")
            if state.long_since is not None and self._since(state) > state.long_since:
                state.long_since = None  # the long phase is over
        ranks = self._world()
        stalled = self._stalled(now)
        if not stalled:
            return []
        if len(stalled) < len(ranks):
            # Others moved. Reports leave each rank about once a second: a rank is behind
            # only once the others kept reporting for longer. Only ranks that step count
            # (one in a phase or yet to step is no sign: the stalled may wait for it).
            grace = max(_REPORT_GRACE_S, 2 * (self._median_step() or 0.0))
            moving = [s for s in ranks.values() if s not in stalled and s.phase is None]
            moving = [s for s in moving if s.steps and now - s.arrived_at <= grace]
            steady = any(s.streak_from and now - s.streak_from > _REPORT_GRACE_S for s in moving)
            culprits = stalled if steady else [s for s in stalled if is_stopped(s)]
        else:
            culprits = self._outside(ranks, now)
        new = []
        for state in culprits:
            if ("hang", state.rank) in self._flags:
                continue
            since = self._since(state)
            if self._busy(state) and now - since <= self.long_bound():
                self._long_phase(state, since, now)
                continue
            flag = Flag("hang", state.rank, state.host, since)
            self._flags[("hang", state.rank)] = flag
            new.append(flag)
        return new

    def _fresh(self, now: float) -> bool:
        """The ranks' latest answers still say where they are: asked within the last
        few seconds, and no rank made progress since (a rank that moved is elsewhere)."""
        if now - self._answered_at > _ANSWERS_FRESH_S:
            return False
        return all(last_sign(s) <= self._answered_at for s in self._ranks.values())

    def _outside(self, ranks: dict[int, RankState], now: float) -> list[RankState]:
        """Of ranks that all stalled: the culprits, never a rank that only waits.

        Before any rank's first step, silence says nothing (a loop may report no
        steps at all): a rank is named only when stopped by a signal, or when the
        ranks' positions in their collectives stood still between two asks.
        """
        fresh = self._fresh(now)
        if not self.reporting:
            stopped = [s for s in ranks.values() if now_state(s) == _probe.STOPPED]
            still = self._confirmed(now) and _collectives.stood_still(self._earlier, self._answers)
            if stopped or not still:
                return stopped
        if fresh:
            named = _collectives.culprits_of(self._answers)
            if named is not None:
                return [ranks[r] for r in named if r in ranks]
        if not self.reporting:
            return []
        if any(p.backend == "nccl" for ps in self._answers.values() for p in ps):
            # A rank waiting on NCCL spins in a CUDA sync, which /proc reads as work: on
            # GPU ranks it tells waiting from working by nothing but a stop.
            return [s for s in ranks.values() if now_state(s) == _probe.STOPPED]
        busy = {r for r, s in ranks.items() if self._busy(s)}
        return stuck_outside(list(ranks.values()), busy)

    def _long_phase(self, state: RankState, since: float, now: float) -> None:
        """Tell the cell once that ``state`` is busy outside collectives while others wait."""
        if state.long_since == since:
            return
        state.long_since = since
        busy = now - since
        named = f" ({state.phase})" if state.phase else ""
        message = (
            f"rank {state.rank} on {state.host or 'an unknown node'} is in a long phase{named} "
            f"outside collectives (busy {busy:.0f} s); it is named as hung if it stops using "
            f"the CPU or is still there after {self.long_bound():.0f} s"
        )
        self._book.notice(
            "long_phase",
            message,
            rank=state.rank,
            node=state.host,
            since=round(self._book.epoch(since), 3),
            busy_s=round(busy, 1),
            step=state.step,
        )

    def _report(self, flags: list[Flag], now: float) -> None:
        with self._lock:
            ranks = dict(self._ranks)
            bounds = {r: self._bound_of(s) for r, s in ranks.items()}
            fresh = self._fresh(self._clock())
            answers = self._answers if fresh else None
        if answers is None:
            answers = self._ask_collectives()
        report = report_hang(
            flags,
            ranks,
            answers,
            now,
            self._book.epoch,
            self.world_size,
            {r: bounds.get(r, self.startup_bound()) for r in range(self.world_size)},
            self._localize,
        )
        with self._lock:
            self._reports.append(report)
        if self._on_hang is not None:
            self._on_hang(report)

    # --- stragglers (scored by ._stragglers) ---------------------------------------------

    def _bin(self, now: float) -> None:
        """Close this second's samples into each rank's window (or drop them: a pause)."""
        latest = max((s.progressed_at for s in self._ranks.values()), default=0.0)
        median = self._median_step() or 0.0
        flowing = now - latest < 2.5 + 2 * median
        paused = self._paused_from <= now <= self._paused_until
        paused_from = self._paused_from if paused else None
        self._stragglers.bin(self._ranks.values(), now, flowing, paused_from)

    def _send_posted(self) -> None:
        with self._lock:
            posted = self._book.take_posted()
        for kind, message, fields in posted:
            events.emit(kind, message, **fields)
