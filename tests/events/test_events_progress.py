"""``events.step`` and the kernel's watchdog over progress reports.

The watchdog's input is the bus; its view of a rank's process is /proc and
py-spy. These tests feed it progress events for real processes (waiting on a
lock, sleeping, stopped by SIGSTOP) and read the flags it emits.
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
from nbtools.events import Event, Watchdog, _procstate
from nbtools.events._progress import progress_so_far


def test_step_counts_in_a_process_without_channel_and_checks_its_argument():
    _, before, _ = progress_so_far()
    events.step(7)
    events.step(None)  # a numbered step came first: this batch mark counts no step
    last, count, at = progress_so_far()
    assert count == before + 1 and last == 7 and at > 0
    with pytest.raises(TypeError, match="events.step takes the step number as an int"):
        events.step("7")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        events.step(True)  # type: ignore[arg-type]


def test_a_rank_reports_coalesced_progress_through_the_channel():
    bus = events.Bus()
    code = """
        import time
        from nbtools import events
        for i in range(20000):
            events.step(i)
        time.sleep(1.5)   # the flusher ships the latest count about once a second
        for i in range(20000, 20010):
            events.step(i)
    """
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="3")
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], env=env, check=True, timeout=120
        )
        collector.drain()
    reports = [e for e in bus.log() if e.kind == "progress"]
    assert reports and len(reports) <= 5  # one a second, not one a step
    assert all(e.rank == 3 for e in reports)
    assert reports[-1].step == 20009 and reports[-1].fields["steps"] == 20010


def test_a_loop_with_the_loader_and_the_manager_counts_one_step_per_training_step(tmp_path):
    """Batch marks count as steps only until the rank reports numbered steps."""
    bus = events.Bus()
    code = """
        import sys, time
        from nbtools.checkpoint import CheckpointManager
        from nbtools.data import DataLoader
        loader = DataLoader(list(range(40)), batch_size=2, num_workers=0)
        with CheckpointManager(sys.argv[1]) as ckpt:   # no every=: nothing is saved
            for step, batch in enumerate(loader):      # a mark per batch...
                time.sleep(0.01)
                ckpt.maybe_save(step)                  # ...and a numbered step
        time.sleep(1.5)   # the report of the training steps leaves
        for batch in loader:                           # an evaluation: marks only
            time.sleep(0.01)
    """
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="0")
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), str(tmp_path / "ckpt")],
            env=env,
            check=True,
            timeout=120,
        )
        collector.drain()
    reports = [e for e in bus.log() if e.kind == "progress"]
    assert reports, bus.log()
    # 20 training steps; the first batch came before the first numbered step.
    assert reports[-1].step == 19 and reports[-1].fields["steps"] == 21, reports
    # The evaluation's batches say the rank is alive, later than its last step.
    assert reports[-1].fields["alive"] > reports[-1].time


def test_a_rank_whose_batches_go_on_is_alive_and_keeps_its_step_times():
    dog = Watchdog(2, hang_timeout=5.0)
    now = time.time()
    dog._on_events(
        [
            _progress(r, 100 + r, s, now - 20 + s, host="node-x")
            for r in (0, 1)
            for s in (1, 2, 3, 4)
        ]
    )
    before = list(dog._ranks[1].step_times)
    report = _progress(1, 101, 4, now - 16, host="node-x")
    report.fields["alive"] = now - 0.2  # evaluation batches: no step, but alive
    dog._on_events([report])
    assert list(dog._ranks[1].step_times) == before
    # Judged 3 s on: rank 1's marks kept coming, rank 0 shows nothing for 19 s.
    new = dog._judge_hangs(now + 3.0)
    assert [f.rank for f in new] == [0]


def test_events_name_the_node_from_the_environment_and_its_host_stays_local():
    bus = events.Bus()
    node = f"{socket.gethostname()}{events.NODE_SEPARATOR}1a2b3c4d"
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="2", **{events.NODE_ENV: node})
        code = "from nbtools import events; events.step(5); events.flush()"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
        collector.drain()
    (report,) = [e for e in bus.log() if e.kind == "progress"]
    assert report.host == node and report.rank == 2
    dog = Watchdog(3)
    dog._on_events([report, _progress(1, 101, 5, time.time(), host="gpu-b · 1a2b3c4d")])
    assert dog._ranks[2].local and not dog._ranks[1].local  # its process can be read here


def _process(code: str, state: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])
    assert _wait_until(lambda: _procstate.sample(proc.pid)[1] == state), state
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
    dog = Watchdog(3, threshold=0.75, window_s=30, confirm_s=0.5)
    start = time.time() - 30
    batch = []
    for i in range(1, 31):  # ranks 0 and 1 step every 0.25 s, rank 2 every 0.5 s
        for rank, period in ((0, 0.25), (1, 0.25), (2, 0.5)):
            steps = int(i / period)
            batch.append(_progress(rank, 100 + rank, steps, start + i, host=f"node-{rank}"))
    dog._on_events(batch)
    dog._evaluate(start + 30.0)
    dog._evaluate(start + 31.0)
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
    with pytest.raises(ValueError, match="NBTOOLS_STRAGGLER_WINDOW_S must be a number"):
        Watchdog(2)
    with pytest.raises(ValueError, match="threshold"):
        Watchdog(2, threshold=1.5, window_s=1)


def test_the_words_about_collectives_name_the_one_in_flight_and_who_never_entered_it():
    from nbtools.events import _collectives

    def at(enqueued, completed, op="all_reduce"):
        return [
            {"pg": "0", "enqueued": enqueued, "completed": completed, "op": op, "op_seq": enqueued}
        ]

    answers = {0: at(1812, 1811), 2: at(1812, 1811), 3: at(1812, 1811), 1: at(1811, 1811)}
    (line,) = _collectives.describe(answers, culprits=[1], world_size=4)
    assert line == (
        "ranks 0, 2, 3 wait in all_reduce #1812, which rank 1 never entered "
        "(last entered: rank 1: #1811)"
    )
    del answers[1]  # stopped: it cannot answer
    (line,) = _collectives.describe(answers, culprits=[1], world_size=4)
    assert line.startswith("ranks 0, 2, 3 wait in all_reduce #1812, rank 1 could not answer")
    # Every rank done with its last collective: nothing in flight, nothing to say.
    assert _collectives.describe({0: at(5, 5), 1: at(5, 5)}, culprits=[1], world_size=2) == []


def test_the_kernel_asks_ranks_elsewhere_through_the_askers_launchers_add():
    from nbtools.events import _collectives

    calls = []

    def ask():
        calls.append("ray")
        return 3  # three ranks asked

    def broken():
        raise RuntimeError("the cluster is gone")

    events.add_collectives_asker(broken)
    events.add_collectives_asker(ask)
    try:
        assert _collectives.ask_all() >= 3  # a failing asker does not silence the others
        assert calls == ["ray"]
    finally:
        events.remove_collectives_asker(ask)
        events.remove_collectives_asker(broken)
    events.remove_collectives_asker(ask)  # harmless twice
    _collectives.ask_all()
    assert calls == ["ray"]


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
