"""The run's events on the pane: carried by the per-poll messages, bounded, kept while paused.

Events are emitted in this process (the kernel's own bus, as ``events.emit``
does in a notebook); the front end is a recording comm.
"""

from __future__ import annotations

import gzip
import sys
from importlib import resources

import numpy as np
import pytest
from _monitor_fakes import message_bytes

from nbtools import events
from nbtools.monitor import GPUPane, SimulatedBackend, acquire, release
from nbtools.monitor.readings import local_host
from nbtools.monitor.snapshot import COLORS
from nbtools.monitor.timeline import MESSAGE_BUDGET, category, encode

pytest.importorskip("anywidget", reason="the pane's chart needs anywidget")


pytestmark = pytest.mark.usefixtures("clean_bus")


def _poll(sampler, clock, seconds: float = 10) -> None:
    clock.advance(seconds)
    sampler.tick()


def test_plotly_js_is_no_widget_state_and_travels_in_a_custom_message(comms, driven, clock):
    sampler = driven(num_gpus=8, history_seconds=7200)
    for _ in range(sampler.samples.capacity):  # two full hours of 8 GPUs on screen
        _poll(sampler, clock)
    pane = GPUPane(backend=SimulatedBackend(8), display=False)
    try:
        # Nothing a notebook saves (the models' state) holds plotly.js.
        opened = sum(c.open_bytes() for c in comms)
        assert opened < 150_000, f"the pane opens with {opened} bytes of widget state"
        chart = pane._chart.comm
        assert chart.sent == [] or all(m["buffers"] == [] for m in chart.sent)
        # A page without plotly.js asks; the answer is a custom message with one gzip buffer.
        chart.from_front_end({"method": "custom", "content": {"k": "lib"}})
        answer = chart.sent[-1]
        assert answer["data"] == {"method": "custom", "content": {"k": "lib"}}
        shipped = resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
        assert gzip.decompress(bytes(answer["buffers"][0])) == shipped
        assert len(answer["buffers"][0]) < len(shipped) / 2
        # Once a view says its page holds it, nothing more is pushed to this chart.
        assert pane._chart.needs_library
        chart.from_front_end({"method": "custom", "content": {"k": "have"}})
        assert not pane._chart.needs_library
    finally:
        pane.close()


def test_the_history_travels_as_binary_arrays_that_decode_to_the_samples(comms, driven, clock):
    sampler = driven(num_gpus=3)
    for _ in range(5):
        _poll(sampler, clock)
    pane = GPUPane(backend=SimulatedBackend(3), display=False)
    try:
        figure = pane._chart.comm.opened_state()["_figure"]
        assert len(figure["data"]) == 3 * 3 and "x" not in figure["data"][0]
        times, util = sampler.samples.series("simulated", 1, "utilization")
        x = np.frombuffer(figure["x"][figure["xi"][1]], "<f8")
        assert x.tolist() == (times * 1000).tolist()
        y = np.frombuffer(figure["y"][1], "<u2") / figure["f"][0]  # panel 0, GPU 1
        assert np.allclose(y, util, atol=0.05)
        _, memory = sampler.samples.series("simulated", 2, "memory_used")
        y = np.frombuffer(figure["y"][3 + 2], "<u2") / figure["f"][1]
        assert np.allclose(y, memory / 1024**3, atol=0.005)
    finally:
        pane.close()


def test_events_ride_in_the_poll_message_with_their_drawing(comms, driven, clock):
    sampler = driven()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        events.emit(
            "checkpoint_saved",
            message="saved step_200",
            step=200,
            blocked_s=0.4,
            upload_s=3.0,
            bytes=123_456,
        )
        events.emit("input_stall", rank=1, seconds=2.5)
        events.emit("rank_failed", message="rank 1 exited with SIGKILL", rank=1)
        events.emit("eval", message="val loss 1.93", step=200, value=1.93)
        assert chart.custom_messages() == []  # nothing is sent from the delivering thread
        _poll(sampler, clock)
        message = chart.custom_messages()[-1]
        rows = {row[1]: row for row in message["e"]}
        assert list(rows) == ["checkpoint_saved", "input_stall", "rank_failed", "eval"]
        saved = rows["checkpoint_saved"]
        assert saved[2] == "save" and saved[4] == 200
        assert saved[0] - saved[5] == pytest.approx(3400, abs=2)  # band ends when the upload began
        assert rows["input_stall"][2] == "stall" and rows["input_stall"][3] == 1
        assert rows["input_stall"][0] - rows["input_stall"][5] == pytest.approx(2500, abs=2)
        assert rows["rank_failed"][2] == "failure" and rows["rank_failed"][5] is None
        assert rows["eval"][2] == "mark" and "val loss 1.93" in rows["eval"][6]
        assert "value=1.93" in rows["eval"][6]
        _poll(sampler, clock)
        assert "e" not in chart.custom_messages()[-1]  # each event is sent once
    finally:
        pane.close()


def test_a_burst_of_events_keeps_every_poll_within_the_budget(comms, driven, clock):
    sampler = driven(num_gpus=8)
    pane = GPUPane(backend=SimulatedBackend(8), display=False)
    try:
        chart = pane._chart.comm
        for step in range(500):
            events.emit("eval", message="x" * 100, step=step, value=float(step))
        for step in range(60):
            events.emit("checkpoint_saved", message=f"saved step_{step}", step=step, blocked_s=0.1)
        sent = len(chart.sent)
        for _ in range(4):
            _poll(sampler, clock)
        polls = chart.sent[sent:]
        assert len(polls) == 4 and all(message_bytes(m) <= MESSAGE_BUDGET for m in polls)
        rows = [row for m in polls for row in m["data"]["content"].get("e", [])]
        # nbtools' own events go first, all of them, in order; user events follow,
        # oldest first, and the rest wait for the next polls.
        saves = [row[4] for row in rows if row[1] == "checkpoint_saved"]
        assert saves == list(range(60))
        evals = [row[4] for row in rows if row[1] == "eval"]
        assert evals == list(range(len(evals))) and 0 < len(evals) < 500
        assert pane._feed.pending == 500 - len(evals)
        assert pane._feed.not_drawn == 0
        # A flood overflows the bounded queue: the oldest are counted as not drawn.
        for step in range(2000):
            events.emit("eval", step=step)
        _poll(sampler, clock)
        content = chart.custom_messages()[-1]
        assert message_bytes(chart.sent[-1]) <= MESSAGE_BUDGET
        assert content["nd"] == pane._feed.not_drawn == 500 - len(evals) + 2000 - 1000
        assert len(pane.events()) == 2560  # the bus keeps them all
    finally:
        pane.close()


def test_events_are_kept_while_paused_and_drawn_on_resume(comms, driven, clock):
    sampler = driven(idle_timeout=300)
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        _poll(sampler, clock, 301)
        assert pane.status == "paused"
        sent = len(chart.sent)
        events.emit("restart", message="restarting all 2 ranks", attempt=1)
        events.emit("eval", step=5, value=1.0)
        _poll(sampler, clock)
        assert not [m for m in chart.sent[sent:] if m["data"].get("method") == "custom"]
        pane.refresh()  # any use resumes
        rows = chart.custom_messages()[-1]["e"]
        assert [row[1] for row in rows] == ["restart", "eval"]
        assert rows[0][2] == "restart"
    finally:
        pane.close()


def test_dropped_events_are_shown(comms, driven, clock):
    sampler = driven()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        assert chart.opened_state()["_figure"]["d"] == 0
        events.bus().publish([], dropped=7, source=("node1", 1, 1234))
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["d"] == 7 and pane.dropped_events == 7
        _poll(sampler, clock)
        assert "d" not in chart.custom_messages()[-1]  # said once, until it changes
    finally:
        pane.close()


def test_a_view_that_resynchronises_gets_the_events_kept(comms, driven, clock):
    driven()
    events.emit("launch", message="2 ranks (local)", world_size=2)  # before the pane opened
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        assert [row[1] for row in chart.opened_state()["_figure"]["ev"]] == ["launch"]
        events.emit("finished", message="done")
        chart.from_front_end({"method": "custom", "content": {"k": "sync", "n": -1}})
        update = chart.sent[-1]
        figure = update["data"]["state"]["_figure"]
        assert [row[1] for row in figure["ev"]] == ["launch", "finished"]
        assert pane._feed.pending == 0
    finally:
        pane.close()


def test_events_as_a_frame_and_as_rows(comms, driven, monkeypatch):
    driven()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        events.emit("checkpoint_saved", message="saved", step=100, blocked_s=0.25)
        events.emit("eval", message="val", step=100, value=1.5, split="val")
        pd = pytest.importorskip("pandas")
        frame = pane.events()
        assert list(frame.columns[:7]) == ["time", "host", "rank", "kind", "message", "step", "pid"]
        assert {"blocked_s", "value", "split"} <= set(frame.columns)
        assert list(frame["kind"]) == ["checkpoint_saved", "eval"]
        assert isinstance(frame["time"].dtype, pd.DatetimeTZDtype)
        assert frame.loc[0, "blocked_s"] == 0.25 and frame.loc[1, "split"] == "val"
        monkeypatch.setitem(sys.modules, "pandas", None)
        rows = pane.events()
        assert isinstance(rows, list) and rows[1]["value"] == 1.5 and rows[0]["step"] == 100
    finally:
        pane.close()


def test_closing_the_pane_stops_receiving_events(comms, driven):
    driven()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    assert pane._feed._arrived in events.bus()._subscribers
    pane.close()
    assert pane._feed._arrived not in events.bus()._subscribers
    events.emit("eval", value=1.0)
    assert pane._feed.pending == 0


def test_kinds_and_spans():
    assert [
        category(k)
        for k in (
            "checkpoint_saved",
            "input_stall",
            "rank_failed",
            "restart",
            "launch",
            "finished",
            "checkpoint_restored",
            "phase",
            "eval",
        )
    ] == ["save", "stall", "failure", "restart", "run", "run", "restore", "phase", "mark"]
    event = events.Event(100.0, "h", 0, 1, "checkpoint_saved", None, 3, {"blocked_s": "bad"})
    assert encode(event)[5] is None  # no usable duration: drawn as an instant
    # A restore is drawn over the seconds it took, ending when the state was back.
    fields = {"seconds": 0.25, "tier": "memory"}
    restored = events.Event(100.0, "h", 0, 1, "checkpoint_restored", "restored", 12, fields)
    assert encode(restored)[5] == 99_750
    long = events.Event(100.0, "other", 0, 1, "eval", "m" * 500, None, {})
    text = encode(long, local_host="here")[6]
    assert text.startswith("other · ") and len(text) == 160


def test_a_pane_with_no_gpu_still_lists_events_as_they_arrive(comms, fake_pynvml, monkeypatch):
    import threading
    import time

    import nbtools.monitor.pane as pane_module

    monkeypatch.setattr(pane_module, "EVENTS_TICK_S", 0.05)
    fake_pynvml([], init_error="NVMLError_DriverNotLoaded")
    pane = GPUPane(display=False)
    try:
        assert pane.status == "unavailable"
        chart = pane._chart.comm
        first = chart.opened_state()["_figure"]["n"]
        events.emit("checkpoint_saved", message="saved step_10", step=10, blocked_s=0.1)
        events.emit("rank_failed", message="rank 1 exited with SIGKILL", rank=1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            kinds = [row[1] for m in chart.custom_messages() for row in m.get("e", [])]
            if len(kinds) == 2:
                break
            time.sleep(0.02)
        messages = chart.custom_messages()
        assert kinds == ["checkpoint_saved", "rank_failed"]
        assert {m["k"] for m in messages} == {"e"}  # events on their own: no GPU sample
        assert [m["n"] for m in messages] == list(range(first + 1, first + 1 + len(messages)))
    finally:
        pane.close()
    assert not [t for t in threading.enumerate() if t.name == "nbtools-pane-events"]


def _report(rank: int, steps: int, at: float) -> events.Event:
    return events.Event(at, "node-b", rank, 1000 + rank, "progress", None, steps, {"steps": steps})


def test_step_rates_ride_the_polls_and_a_new_rank_brings_the_whole_figure(comms, driven, clock):
    import time

    sampler = driven()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        assert chart.opened_state()["_figure"]["ranks"] == []
        t0 = time.time() - 10
        events.bus().publish([_report(0, 10, t0), _report(1, 10, t0)])
        events.bus().publish([_report(0, 20, t0 + 2), _report(1, 15, t0 + 2)])
        _poll(sampler, clock)
        figure = chart.sent[-1]["data"]["state"]["_figure"]  # new ranks: the whole figure
        # Each rate is drawn over the interval it measures: from one report to the next.
        assert figure["ranks"] == [0, 1] and figure["ry"] == [[5.0, 5.0], [2.5, 2.5]]
        assert [t["name"] for t in figure["data"][-2:]] == ["rank 0", "rank 1"]
        assert figure["layout"]["annotations"][-1]["text"] == "Steps per second, by rank"
        events.bus().publish([_report(0, 30, t0 + 4), _report(1, 16, t0 + 4)])
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["sr"] == [
            [0, round((t0 + 2) * 1000), 5.0],
            [0, round((t0 + 4) * 1000), 5.0],
            [1, round((t0 + 2) * 1000), 0.5],
            [1, round((t0 + 4) * 1000), 0.5],
        ]
        # Rank 1 goes silent while rank 0 reports: it drops to 0 steps/s.
        events.bus().publish([_report(0, 60, t0 + 10)])
        _poll(sampler, clock)
        points = chart.custom_messages()[-1]["sr"]
        assert [0, round((t0 + 10) * 1000), 5.0] in points
        assert [1, round((t0 + 4) * 1000), 0.0] in points  # from its last report on
        assert [1, round((t0 + 10) * 1000), 0.0] in points
        # A restarted rank counts from zero: no rate is drawn over the restart.
        events.bus().publish([_report(0, 1, t0 + 16)])  # the first report of the new process
        events.bus().publish([_report(0, 5, t0 + 17)])
        _poll(sampler, clock)
        points = [p for p in chart.custom_messages()[-1]["sr"] if p[0] == 0]
        assert points[:3] == [
            [0, round((t0 + 16) * 1000), None],  # a break in the line
            [0, round((t0 + 16) * 1000), 4.0],
            [0, round((t0 + 17) * 1000), 4.0],
        ], points
    finally:
        pane.close()


def test_a_flag_is_listed_as_the_on_call_engineer_reads_it():
    base = {"node": "node-b", "since": 1000.0}
    hang = events.Event(
        1090.0,
        "k",
        5,
        1,
        "hang",
        "long text",
        None,
        {**base, "stalled_s": 90.0, "collective": "all_reduce #1812", "entered": True},
    )
    row = encode(hang)
    assert row[6] == "rank 5 on node-b stalled 90 s in all_reduce #1812" and row[7] == 0
    assert row[5] == 1000000  # the band starts where the hang began
    outside = events.Event(
        1090.0,
        "k",
        1,
        1,
        "hang",
        "long text",
        None,
        {**base, "stalled_s": 90.0, "collective": "all_reduce #1812", "entered": False},
    )
    assert encode(outside)[6] == (
        "rank 1 on node-b stalled 90 s; the others wait in all_reduce #1812, which it never entered"
    )
    straggler = events.Event(
        1090.0,
        "k",
        3,
        1,
        "straggler",
        "rank 3 on node-b at 0.62 of the median step rate since 12:04:00",
        None,
        {**base, "score": 0.62},
    )
    assert encode(straggler)[6].startswith("rank 3 on node-b at 0.62 of the median step rate")
    ended = events.Event(
        1200.0, "k", 3, 1, "straggler", "rank 3 on node-b: over", None, {**base, "ended": True}
    )
    assert encode(ended)[7] == 1


def test_a_pane_with_no_gpu_draws_only_the_step_rates(comms, fake_pynvml):
    import time

    fake_pynvml([], init_error="NVMLError_DriverNotLoaded")
    t0 = time.time() - 10
    events.bus().publish([_report(0, 10, t0), _report(0, 20, t0 + 1)])
    pane = GPUPane(display=False)
    try:
        figure = pane._chart.comm.opened_state()["_figure"]
        assert figure["ranks"] == [0] and figure["gpus"] == []
        assert [a["text"] for a in figure["layout"]["annotations"]] == ["Steps per second, by rank"]
        assert figure["ey"] == ["y2", 1]  # the events' marks get an axis of their own
        assert "no GPU" in figure["layout"]["title"]["text"]
    finally:
        pane.close()


def test_a_gpu_row_pairs_with_the_rank_that_uses_it_by_uuid(comms, clock):
    here = local_host()  # the ranks' events carry their host, as the GPUs' samples do
    sampler = acquire(
        SimulatedBackend(2, host=here), clock=clock, start=False, interval=10, idle_timeout=None
    )
    pane = GPUPane(backend=SimulatedBackend(2, host=here), display=False)
    try:
        chart = pane._chart.comm
        nvml_uuid = sampler.last_sample.gpus[1].uuid  # "GPU-…", as NVML says it
        # What a rank on GPU 1 announces: CUDA's UUID, which torch prints without "GPU-".
        events.emit("rank_gpu", rank=3, uuid=nvml_uuid.removeprefix("GPU-"), cuda=0)
        _poll(sampler, clock)
        figure = chart.sent[-1]["data"]["state"]["_figure"]  # the figure is sent again
        traces = {t["name"]: t for t in figure["data"]}
        assert "GPU 1 · rank 3" in traces and "GPU 0" in traces
        assert traces["GPU 1 · rank 3"]["line"]["color"] == COLORS[3]  # the rank's colour
        assert [g[5] for g in figure["gpus"]] == ["0", "1 · rank 3"]
        assert all(row[1] != "rank_gpu" for row in figure["ev"])  # nothing to draw
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["k"] == "s"  # and not sent again
    finally:
        pane.close()
        release(sampler)


def test_a_rank_without_cuda_announces_nothing(clean_bus):
    from nbtools.monitor.timeline import announce_rank_gpu

    announce_rank_gpu()  # CPU torch here: no CUDA started
    assert events.log(kinds=["rank_gpu"]) == []
