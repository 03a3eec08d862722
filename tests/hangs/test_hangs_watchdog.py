"""The kernel's watchdog over progress reports: hangs and stragglers.

The watchdog's input is the bus; its view of a rank's process is /proc and
py-spy. These tests feed it progress events for real processes (waiting on a
lock, sleeping, stopped by SIGSTOP) and read the flags it emits. Where a test
moves time on, it gives the watchdog a clock of its own: the watchdog judges by
when reports reach the kernel, never by the ranks' clocks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nbtools import events
from nbtools._hangs import Watchdog, _collectives
from nbtools._hangs import _process as _procstate
from nbtools.events import Event, _probe


class _Clock:
    """The kernel's monotonic clock, moved on by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _process(code: str, state: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])
    assert _wait_until(lambda: _probe.sample(proc.pid)[1] == state), state
    return proc


def _progress(rank: int, pid: int, steps: int, at: float, host: str | None = None) -> Event:
    return Event(
        at,
        host or socket.gethostname(),
        rank,
        pid,
        "progress",
        None,
        steps,
        {"steps": steps, "cpu": 0.0},
    )


@pytest.fixture
def flags():
    seen: list[Event] = []
    got = threading.Event()

    def keep(batch):
        for event in batch:
            if event.kind in ("hang", "straggler"):
                seen.append(event)
                got.set()

    events.subscribe(keep)
    yield seen, got
    events.unsubscribe(keep)


def _wait_until(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_rank_whose_batches_go_on_is_alive_and_keeps_its_step_times():
    clock = _Clock()
    dog = Watchdog(2, hang_timeout=5.0, clock=clock)
    now = time.time()
    dog._on_events(
        [
            _progress(r, 100 + r, s, now - 20 + s, host="node-x")
            for r in (0, 1)
            for s in (1, 2, 3, 4)
        ]
    )
    before = list(dog._ranks[1].step_times)
    assert before == [1.0, 1.0, 1.0]  # from the rank's own clock: differences only
    for later in (4.0, 1.5, 1.0):  # evaluation batches: no step, but alive
        clock.now += later
        report = _progress(1, 101, 4, now - 16, host="node-x")
        report.fields["alive"] = now + clock.now - 1000.0
        dog._on_events([report])
    assert list(dog._ranks[1].step_times) == before
    # Judged half a second on: rank 1's marks keep coming, rank 0 shows nothing for 7 s.
    clock.now += 0.5
    new = dog._judge_hangs(clock.now)
    assert [f.rank for f in new] == [0]


def test_a_rank_whose_clock_is_a_minute_behind_is_judged_by_when_its_reports_arrive():
    clock = _Clock()
    dog = Watchdog(2, hang_timeout=5.0, clock=clock)
    now = time.time()
    for step in range(1, 30):  # both ranks step every second; rank 1's clock is 60 s behind
        dog._on_events(
            [_progress(0, 100, step, now + step), _progress(1, 101, step, now + step - 60)]
        )
        clock.now += 1.0
        assert dog._judge_hangs(clock.now) == []
    assert dog.bound() == 5.0 and list(dog._ranks[1].step_times)[-1] == pytest.approx(1.0)


def test_a_local_rank_is_sampled_and_a_rank_on_another_node_is_not():
    dog = Watchdog(3)
    node = f"{socket.gethostname()}{events.NODE_SEPARATOR}1a2b3c4d"
    dog._on_events(
        [
            _progress(2, os.getpid(), 5, time.time(), host=node),
            _progress(1, 101, 5, time.time(), host="gpu-b · 1a2b3c4d"),
        ]
    )
    assert dog._ranks[2].local and not dog._ranks[1].local  # its process can be read here


@pytest.mark.slow
def test_only_the_stopped_rank_is_named_not_those_waiting_for_it(flags):
    seen, _ = flags
    waiting = "import threading; threading.Event().wait(60)"
    sleeping = "import time; time.sleep(60)"
    procs = [
        _process(waiting, "futex"),
        _process(waiting, "futex"),
        _process(sleeping, "clock_nanosleep"),
    ]
    os.kill(procs[2].pid, signal.SIGSTOP)
    reports = []
    dog = Watchdog(3, hang_timeout=1.0, on_hang=reports.append).start()
    try:
        now = time.time()
        events.bus().publish([_progress(r, p.pid, 10, now) for r, p in enumerate(procs)])
        assert _wait_until(lambda: reports)
        assert [e.rank for e in seen if e.kind == "hang"] == [2]
        assert reports[0].ranks == (2,)
        text = reports[0].text
        assert "rank 2 on" in text and "stopped by a signal" in text
        assert "Ranks 0, 1 wait for it" in text
        assert text.count("Thread ") >= 3 or "py-spy" in text  # a stack per rank, or why not
        os.kill(procs[2].pid, signal.SIGCONT)
        steps = iter(range(11, 10_000))

        def resumed() -> bool:  # the rank reports its steps again, as a running rank does
            events.bus().publish([_progress(2, procs[2].pid, next(steps), time.time())])
            return any(e.fields.get("ended") for e in seen)

        assert _wait_until(resumed)
        ended = [e for e in seen if e.fields.get("ended")]
        assert [e.rank for e in ended] == [2] and ended[0].fields["lasted_s"] >= 0
    finally:
        dog.stop()
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_known_rank_stopped_before_it_ever_reported_is_named_within_the_hang_bound(flags):
    # A pool's call: the launcher knows its ranks' processes; rank 1 was stopped before
    # its first report of the call reached the kernel, rank 0 waits for it.
    seen, _ = flags
    waiting = "import threading; threading.Event().wait(60)"
    procs = [_process(waiting, "futex"), _process(waiting, "futex")]
    os.kill(procs[1].pid, signal.SIGSTOP)
    reports = []
    dog = Watchdog(2, hang_timeout=1.0, startup_timeout=600, on_hang=reports.append)
    for rank, proc in enumerate(procs):
        dog.know(rank, proc.pid, socket.gethostname())
    dog.start()
    try:
        events.bus().publish([_progress(0, procs[0].pid, 10, time.time())])
        assert _wait_until(lambda: reports)
        assert reports[0].ranks == (1,) and [e.rank for e in seen if e.kind == "hang"] == [1]
        assert "stopped by a signal" in reports[0].text
    finally:
        dog.stop()
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_ranks_that_all_compute_past_the_bound_are_not_a_hang(flags):
    seen, _ = flags
    busy = "import time\nwhile True: time.sleep(0.01)"
    procs = [_process(busy, "clock_nanosleep"), _process(busy, "clock_nanosleep")]
    dog = Watchdog(2, hang_timeout=1.0).start()
    try:
        now = time.time()
        events.bus().publish([_progress(r, p.pid, 5, now) for r, p in enumerate(procs)])
        time.sleep(3.5)  # three bounds: an evaluation every rank runs, nobody waits
        assert dog.flags() == [] and seen == []
    finally:
        dog.stop()
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_rank_on_another_node_behind_the_others_is_a_straggler_named_by_node(flags):
    seen, got = flags
    clock = _Clock()
    dog = Watchdog(3, threshold=0.75, window_s=30, confirm_s=0.5, clock=clock)
    start = time.time() - 30
    batch = []
    for i in range(1, 31):  # ranks 0 and 1 step every 0.25 s, rank 2 every 0.5 s
        for rank, period in ((0, 0.25), (1, 0.25), (2, 0.5)):
            steps = int(i / period)
            batch.append(_progress(rank, 100 + rank, steps, start + i, host=f"node-{rank}"))
    dog._on_events(batch)
    dog._evaluate(clock.now)
    clock.now += 1.0
    dog._evaluate(clock.now)
    dog._send_posted()
    assert got.is_set()
    opened = [e for e in seen if e.kind == "straggler"]
    assert [(e.rank, e.fields["node"]) for e in opened] == [(2, "node-2")]
    assert opened[0].fields["score"] == pytest.approx(0.5, abs=0.05)
    assert opened[0].message.startswith("rank 2 on node-2 is a straggler since ")
    assert "2 steps/s against the median rank's 4 steps/s (score 0.50" in opened[0].message
    assert dog.take_notices() == [opened[0].message]  # one line for the cell
    assert dog.take_notices() == []


def test_bad_settings_are_refused_with_the_name(monkeypatch):
    monkeypatch.setenv("NBTOOLS_STRAGGLER_WINDOW_S", "soon")
    with pytest.raises(ValueError, match="NBTOOLS_STRAGGLER_WINDOW_S='soon' is not a valid"):
        Watchdog(2)
    with pytest.raises(ValueError, match="threshold"):
        Watchdog(2, threshold=1.5, window_s=1)


def test_an_interrupt_while_the_watch_starts_leaves_no_thread_or_subscriber(monkeypatch):
    # Ctrl+C can land while Thread.start waits for the new thread; "with" then never
    # reaches __exit__, so the watch must undo its own start.
    started = threading.Thread.start

    def start_then_interrupted(thread: threading.Thread) -> None:
        started(thread)
        raise KeyboardInterrupt

    before = events.bus()._subscribers
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupted)
    with pytest.raises(KeyboardInterrupt), Watchdog(2):
        pytest.fail("the body must not run")
    monkeypatch.undo()
    assert events.bus()._subscribers == before
    assert not [t for t in threading.enumerate() if t.name == "nbtools-watchdog"]


_RANK = """
import os, sys, threading, time
import torch, torch.distributed as dist
from nbtools import events  # imported before the rank starts, as the launcher's set-up does
from nbtools._internal import hooks
hooks.rank_started()  # what the launcher's rank set-up runs: the rank reports its start
dist.init_process_group(
    "gloo", init_method=f"file://{sys.argv[1]}", rank=int(os.environ["RANK"]), world_size=2
)
if os.environ["RANK"] == "1":
    lock = threading.Lock()
    lock.acquire()
    lock.acquire(timeout=60)  # a deadlock before the first step
else:
    dist.all_reduce(torch.ones(4))  # waits for rank 1
"""


def _ranks(tmp_path, collector):
    return [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(tmp_path / "store")],
            env=dict(os.environ, **collector.environment(), RANK=str(rank)),
        )
        for rank in (0, 1)
    ]


def _end(procs):
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_rank_deadlocked_before_its_first_step_is_named_by_the_start_up_bound(
    tmp_path, monkeypatch
):
    pytest.importorskip("torch")
    monkeypatch.setenv("NBTOOLS_STARTUP_TIMEOUT_S", "4")  # the documented setting
    reports = []
    bus = events.Bus()
    with events.Collector(bus=bus) as collector:
        procs = _ranks(tmp_path, collector)
        dog = Watchdog(2, on_hang=reports.append, bus=bus).start()
        try:
            assert dog.startup_bound() == 4.0
            assert _wait_until(lambda: reports, timeout=90)
            assert [f.rank for f in dog.flags()] == [1]  # never rank 0, which only waits
        finally:
            dog.stop()
            _end(procs)
    (report,) = reports
    assert report.ranks == (1,) and "before its first step" in report.headline
    assert "which rank 1 never entered" in report.headline, report.headline


@pytest.mark.slow
def test_a_deadlock_before_the_first_step_is_named_at_the_bound_counted_from_the_launch(
    tmp_path, monkeypatch
):
    # The watchdog's clock is the test's: it judges at each second the test moves it on,
    # and the ranks are real processes in a real gloo all-reduce. The ranks start some
    # seconds after their launch; the bound counts from the launch, and both looks at
    # the collectives come before it.
    pytest.importorskip("torch")
    monkeypatch.setenv("NBTOOLS_STARTUP_TIMEOUT_S", "20")
    clock = _Clock()
    launched = clock.now
    reports = []
    bus = events.Bus()
    with events.Collector(bus=bus) as collector:
        procs = _ranks(tmp_path, collector)
        clock.now += 3.0  # the ranks' first reports come after their launch
        dog = Watchdog(2, on_hang=reports.append, bus=bus, clock=clock, launched_at=launched)
        bus.subscribe(dog._on_events)  # its input, without its thread: the test ticks
        try:
            assert _wait_until(lambda: len(dog._ranks) == 2)
            pids = {r: s.pid for r, s in dog._ranks.items()}

            def in_place():  # rank 0 inside the all-reduce, rank 1 on its lock
                answers = _collectives.ask({0, 1}, pids)
                return any(p.inside for p in answers.get(0, [])) and all(
                    _probe.sample(pid)[1] == "futex" for pid in pids.values()
                )

            assert _wait_until(in_place, timeout=60)
            assert all(s.started_at == launched for s in dog._ranks.values())
            edge = launched + 20.0
            looks, flagged = [], None
            while clock.now < edge + 5 and flagged is None:
                clock.now += 1.0
                for _ in range(3):
                    dog._sample()
                asked = dog._answered_at
                dog._evaluate(clock.now)
                if dog._answered_at != asked:
                    looks.append(clock.now)
                if dog.flags():
                    flagged = clock.now
        finally:
            bus.unsubscribe(dog._on_events)
            dog.stop()
            _end(procs)
    assert len(looks) == 2 and looks[-1] < edge, (looks, edge)  # both looks before the bound
    assert flagged is not None and edge < flagged <= edge + 1.0  # named at the bound
    (report,) = reports
    (culprit,) = report.culprits  # stalled since its launch, not since its first report
    assert f"made no progress for {flagged - launched:.0f} s" in culprit.why, culprit.why
    assert report.ranks == (1,) and "which rank 1 never entered" in report.headline


def test_a_stack_reads_as_a_traceback_with_each_line_s_text():
    from nbtools._hangs._report import as_traceback

    here = os.path.abspath(__file__)
    lineno = _SOURCE_LINE + 1
    dump = (
        'Thread 7 (idle): "MainThread"\n'
        f"    _marker ({here}:{lineno})\n"
        "    train (<dynamic-code>:41)\n"
    )
    text = as_traceback(dump)
    assert text.splitlines() == [
        'Thread 7 (idle): "MainThread"',
        f'    File "{here}", line {lineno}, in _marker',
        '      return "the line a report shows"',
        '    File "<dynamic-code>", line 41, in train',  # the launcher names these
    ]


def _marker():
    return "the line a report shows"


_SOURCE_LINE = _marker.__code__.co_firstlineno


def test_the_start_up_bound_is_learned_from_the_first_steps_the_group_shows():
    clock = _Clock()
    dog = Watchdog(2, clock=clock)
    now = time.time()
    # Both ranks report as they start; rank 1 then deadlocks before its first step.
    dog._on_events([_progress(r, 100 + r, 0, now, host="node-x") for r in (0, 1)])
    assert dog.startup_bound() == 180.0  # the documented default, before any first step
    for second in range(1, 71):
        clock.now += 1.0
        if second >= 20:  # rank 0's first step took 20 s; then one step a second
            dog._on_events([_progress(0, 100, second - 19, now + second, host="node-x")])
        if second == 20:
            assert dog.startup_bound() == 60.0  # three times the slowest first step
        flagged = [f.rank for f in dog._judge_hangs(clock.now)]
        if flagged:
            break
    assert flagged == [1] and 60 < second < 65  # named by the learned bound, not after 180 s


def test_a_coloured_py_spy_dump_reads_as_a_traceback():
    # py-spy colours its dump where the environment asks for colour (a notebook kernel).
    from nbtools._hangs._report import as_traceback

    dump = (
        "Process 4242: python\nPython v3.11.7\n\n"
        'Thread \x1b[33m\x1b[1m4242\x1b[0m (idle): "MainThread"\n'
        f"    \x1b[32mtrain\x1b[0m (\x1b[36m{__file__}\x1b[0m:\x1b[2m1\x1b[0m)\n"
    )
    text = as_traceback(_procstate._trim(dump))
    assert text.splitlines()[0] == 'Thread 4242 (idle): "MainThread"'
    assert f'File "{__file__}", line 1, in train' in text and "\x1b" not in text
