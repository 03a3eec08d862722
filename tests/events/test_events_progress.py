"""``events.step``: a rank's step boundaries, coalesced into progress reports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from nbtools import events
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_phase_travels_in_the_rank_s_reports_while_it_is_open():
    bus = events.Bus()
    code = """
        import time
        from nbtools import events
        from nbtools._internal import hooks
        hooks.rank_started()            # what the launcher's rank set-up runs
        time.sleep(1.5)                 # the start is reported before any step
        with events.phase("evaluate"):
            time.sleep(1.5)

        @events.phase("save")
        def save():
            time.sleep(1.5)

        save()
        events.step(1)
        time.sleep(1.5)
    """
    seen: list[events.Event] = []
    bus.subscribe(seen.extend)
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="0")
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], env=env, check=True, timeout=120
        )
        collector.drain()
    progress = [e for e in seen if e.kind == "progress"]
    reports = [
        (e.fields["steps"], e.fields.get("phase")) for e in progress if "still" not in e.fields
    ]
    assert reports == [(0, None), (0, "evaluate"), (0, "save"), (1, None)], reports
    # While nothing moves, the rank's look at itself still leaves every second: its
    # training thread sleeps (working, outside any collective), its tree's use so far.
    still = [e.fields for e in progress if e.fields.get("still")]
    assert still and {f["phase"] for f in still if "phase" in f} <= {"evaluate", "save"}
    assert all(f["state"] == "working" and f["tree_cpu"] > 0 for f in still), still
    # The start report reaches the hang watch (a subscriber) but not the user's log.
    logged = [(e.fields["steps"], e.fields.get("phase")) for e in bus.log(kinds=["progress"])]
    assert logged == reports[1:], logged


def test_a_phase_needs_a_short_name():
    with pytest.raises(TypeError, match="events.phase takes a name"):
        events.phase(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 to 100 characters"):
        events.phase("")
