"""GPUPane with a recording comm in place of the front end (the ipywidgets testing approach)."""

from __future__ import annotations

import threading
import types

import pytest
from _monitor_fakes import message_bytes
from IPython.core.events import EventManager, available_events

import nbtools.monitor.pane as pane_module
from nbtools.errors import MonitorError
from nbtools.monitor import GPUPane, Sample, SimulatedBackend, acquire, release
from nbtools.monitor.sampler import THREAD_NAME

pytest.importorskip("anywidget", reason="the pane's chart needs anywidget")
# The pane draws the kernel's events (a rank's step rate, flags): a test starts without
# those another test in this process left.
pytestmark = pytest.mark.usefixtures("clean_bus")


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture
def driven(clock):
    """A shared sampler on a fake clock and no thread: panes on the same backend key use it."""
    samplers = []

    def start(num_gpus: int = 8, **options):
        options.setdefault("interval", 10)
        samplers.append(acquire(SimulatedBackend(num_gpus), clock=clock, start=False, **options))
        return samplers[-1]

    yield start
    for sampler in samplers:
        release(sampler)


def test_each_poll_sends_a_small_custom_message(comms, driven, clock):
    sampler = driven(num_gpus=8)
    pane = GPUPane(backend=SimulatedBackend(8), display=False)
    try:
        assert pane.sampler is sampler and pane.status == "polling"
        chart = pane._chart.comm
        opened = chart.opened_state()
        assert "extendTraces" in opened["_esm"] and "_library" not in opened
        figure = opened["_figure"]
        assert len(figure["data"]) == 24 and figure["source"] == "simulated"
        before = len(chart.sent)
        for _ in range(5):
            clock.advance(10)
            sampler.tick()
        polls = chart.sent[before:]
        assert len(polls) == 5
        assert all(m["data"]["method"] == "custom" for m in polls)
        assert [m["data"]["content"]["n"] for m in polls] == list(
            range(figure["n"] + 1, figure["n"] + 6)
        )
        content = polls[-1]["data"]["content"]
        assert content["t"] == round(clock.now * 1000) and content["r"] == 0
        assert len(content["g"]) == 8 and all(len(row) == 5 for row in content["g"])
        assert max(message_bytes(m) for m in polls) < 1024  # 8 GPUs, not 24 whole traces
    finally:
        pane.close()


def test_a_new_host_resends_the_figure_grouped_by_host(comms, driven, clock):
    sampler = driven(num_gpus=2)
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        remote = SimulatedBackend(3, host="node1")
        sampler.ingest(Sample("node1", clock.now, tuple(remote.read(clock.now)), "simulated"))
        update = chart.sent[-1]["data"]
        assert update["method"] == "update"
        figure = update["state"]["_figure"]
        assert figure["hosts"] == 2 and len(figure["data"]) == 15
        assert [g[:2] for g in figure["gpus"]] == [
            ["simulated", 0],
            ["simulated", 1],
            ["node1", 0],
            ["node1", 1],
            ["node1", 2],
        ]
        clock.advance(1)
        sampler.ingest(Sample("node1", clock.now, tuple(remote.read(clock.now)), "simulated"))
        assert chart.custom_messages()[-1]["r"] == 2  # node1's rows follow the local GPUs
    finally:
        pane.close()


def test_a_view_that_missed_messages_gets_the_whole_figure(comms, driven, clock):
    driven(num_gpus=2)
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        current = chart.opened["state"]["_figure"]["n"]
        sent = len(chart.sent)
        chart.from_front_end({"method": "custom", "content": {"k": "sync", "n": current}})
        assert len(chart.sent) == sent  # up to date: nothing to send
        chart.from_front_end({"method": "custom", "content": {"k": "sync", "n": -1}})
        assert chart.sent[-1]["data"]["state"]["_figure"]["n"] == current + 1
    finally:
        pane.close()


def test_buttons_refresh_pause_and_resume(comms, driven, clock):
    sampler = driven(num_gpus=2)
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        refresh, toggle = pane._refresh_button.comm, pane._toggle_button.comm
        clock.advance(3)
        refresh.from_front_end({"method": "custom", "content": {"event": "click"}})
        assert sampler.last_sample.time == clock.now
        assert pane._toggle_button.description == "Pause"
        toggle.from_front_end({"method": "custom", "content": {"event": "click"}})
        assert pane.status == "paused"
        assert "paused by the user" in pane._status_label.value
        assert "simulated GPUs" in pane._status_label.value
        assert pane._toggle_button.description == "Resume"
        toggle.from_front_end({"method": "custom", "content": {"event": "click"}})
        assert pane.status == "polling" and "polling every 10 s" in pane._status_label.value
    finally:
        pane.close()


def test_cells_are_activity(comms, driven, clock, monkeypatch):
    sampler = driven(num_gpus=1, idle_timeout=300)
    shell = types.SimpleNamespace(events=EventManager(None, available_events), execution_count=1)
    monkeypatch.setattr(pane_module, "_ipython", lambda: shell)
    pane = GPUPane(backend=SimulatedBackend(1), display=False)
    try:
        clock.advance(3600)  # the cell that built the pane is still running
        sampler.tick()
        assert pane.status == "polling"
        shell.events.trigger("post_run_cell", None)
        clock.advance(300)
        sampler.tick()
        assert pane.status == "paused" and "no cell has run" in pane._status_label.value
        shell.events.trigger("pre_run_cell", None)
        assert pane.status == "polling"
    finally:
        pane.close()
    assert shell.events.callbacks["pre_run_cell"] == []
    assert shell.events.callbacks["post_run_cell"] == []


def test_history_as_a_frame(comms, driven, clock):
    sampler = driven(num_gpus=3)
    pane = GPUPane(backend=SimulatedBackend(3), display=False)
    try:
        for _ in range(4):
            clock.advance(10)
            sampler.tick()
        frame = pane.history()
        if isinstance(frame, dict):  # pandas absent
            assert len(frame["time"]) == 15
        else:
            assert len(frame) == 15 and {"host", "gpu", "utilization"} <= set(frame.columns)
    finally:
        pane.close()


def test_close_stops_the_thread_and_the_widgets(comms):
    pane = GPUPane(interval=0.01, history=1, backend=SimulatedBackend(2), display=False)
    got = threading.Event()
    pane.sampler.add_sink(lambda s: got.set())
    assert got.wait(timeout=30)
    assert len(sampler_threads()) == 1
    pane.close()
    pane.close()
    assert sampler_threads() == [] and pane.status == "closed"
    assert all(c.closed for c in comms)
    with pytest.raises(MonitorError, match="create a new GPUPane"):
        pane.refresh()


def test_closing_the_widget_closes_the_pane(comms):
    pane = GPUPane(interval=30, backend=SimulatedBackend(2), display=False)
    pane.widget.close()
    assert pane.status == "closed" and sampler_threads() == []


def test_two_panes_on_the_same_gpus_poll_once(comms):
    first = GPUPane(interval=30, backend=SimulatedBackend(2), display=False)
    second = GPUPane(interval=30, backend=SimulatedBackend(2), display=False)
    try:
        assert second.sampler is first.sampler and len(sampler_threads()) == 1
        first.close()
        assert second.status == "polling" and len(sampler_threads()) == 1
    finally:
        first.close()
        second.close()
    assert sampler_threads() == []


def test_no_gpu_is_said_plainly(comms, fake_pynvml):
    fake_pynvml([], init_error="NVMLError_DriverNotLoaded")
    pane = GPUPane(display=False)
    try:
        assert pane.status == "unavailable" and sampler_threads() == []
        assert "driver is installed but not loaded" in pane._status_label.value
        # ... and how to try the pane without one.
        assert "%gpu_pane --simulated 4" in pane._status_label.value
        assert "GPUPane(simulated=4)" in pane._status_label.value
        assert pane.refresh() is None
        assert pane._chart.comm.opened["state"]["_figure"]["data"] == []
    finally:
        pane.close()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"interval": float("inf")}, ValueError, "interval must be a finite number"),
        ({"interval": float("nan")}, ValueError, "interval must be a finite number"),
        ({"interval": -1}, ValueError, "interval must be at least"),
        ({"history": float("nan")}, ValueError, "history must be a finite number"),
        ({"interval": "10"}, TypeError, "interval must be a number"),
    ],
)
def test_bad_timing_is_refused_before_anything_starts(comms, options, error, match):
    with pytest.raises(error, match=match):
        GPUPane(backend=SimulatedBackend(2), display=False, **options)
    assert sampler_threads() == [] and comms == []


def test_the_documented_history_argument_is_seconds_and_history_is_the_samples(
    comms, driven, clock
):
    sampler = driven(num_gpus=2, history_seconds=60)
    pane = GPUPane(
        interval=10, history=60, idle_timeout=300, backend=SimulatedBackend(2), display=False
    )
    try:
        assert pane.sampler is sampler and sampler.history_seconds == 60
        for _ in range(20):
            clock.advance(10)
            sampler.tick()
        frame = pane.history()
        times = frame["time"] if isinstance(frame, dict) else list(frame["time"])
        assert len(set(times)) == 7  # ceil(60 / 10) + 1 samples
    finally:
        pane.close()


def test_cluster_is_checked_before_anything_starts(comms):
    with pytest.raises(ValueError, match="either backend= or cluster="):
        GPUPane(cluster="ray", backend=SimulatedBackend(num_gpus=1), display=False)
    with pytest.raises(ValueError, match="cluster must be 'ray'"):
        GPUPane(cluster="slurm", display=False)


def test_simulated_gpus_by_count_as_the_hint_says(comms):
    pane = GPUPane(simulated=3, display=False)
    try:
        assert pane.sampler.simulated and len(pane.sampler.last_sample.gpus) == 3
        assert "--simulated" not in pane._status_label.value
    finally:
        pane.close()
    with pytest.raises(ValueError, match="either backend= or simulated="):
        GPUPane(simulated=2, backend=SimulatedBackend(num_gpus=1), display=False)
    with pytest.raises(ValueError, match="positive number of GPUs, got 0"):
        GPUPane(simulated=0, display=False)
    assert sampler_threads() == []
