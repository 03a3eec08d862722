"""The pane's output: a still picture and text beside the live view, kept current off the poll path.

IPython's ``display``/``update_display`` are replaced by a recorder (the
front-end boundary, like the recording comm); the picture is really drawn.
"""

from __future__ import annotations

import base64
import math
import re
import threading
import time

import pytest

import nbtools.monitor._display as display_module
import nbtools.monitor._widget as widget_module
import nbtools.monitor.pane as pane_module
from nbtools import events
from nbtools.monitor import GPUPane, SimulatedBackend

pytest.importorskip("anywidget", reason="the pane's chart needs anywidget")
pytestmark = pytest.mark.usefixtures("clean_bus")

VIEW = "application/vnd.jupyter.widget-view+json"
LINE = re.compile(
    r"^GPU pane · 2 GPUs \(simulated\) · last sample \d\d:\d\d:\d\d · "
    r"util \d+ % / \d+ % · \d+ events?"
)


class Outputs:
    """What the pane put in the notebook: display and update_display calls, by thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, str, str]] = []
        self.changed = threading.Condition()

    def display(self, data, raw=False, display_id=None, **_kw):
        assert raw and display_id
        with self.changed:
            self.calls.append(("display", data, display_id, threading.current_thread().name))
            self.changed.notify_all()

    def update_display(self, data, raw=False, display_id=None, **_kw):
        assert raw and display_id
        with self.changed:
            self.calls.append(("update", data, display_id, threading.current_thread().name))
            self.changed.notify_all()

    def wait(self, count: int, timeout: float = 30) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= count, timeout), self.calls


@pytest.fixture
def outputs(monkeypatch):
    import IPython.display

    recorder = Outputs()
    monkeypatch.setattr(IPython.display, "display", recorder.display)
    monkeypatch.setattr(IPython.display, "update_display", recorder.update_display)
    return recorder


def _png(data: dict) -> bytes:
    png = base64.b64decode(data["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 200_000
    return png


def test_the_output_holds_the_view_then_a_picture_and_text_and_keeps_the_picture(
    comms, driven, clock, outputs
):
    sampler = driven()
    for _ in range(30):
        clock.advance(10)
        sampler.tick()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        pane._display.show()
        (kind, view, view_id, _), (kind2, data, picture_id, _) = outputs.calls
        assert (kind, kind2) == ("display", "display") and view_id != picture_id
        assert view == {
            VIEW: {"version_major": 2, "version_minor": 0, "model_id": pane.widget.model_id},
            "text/plain": "",
        }
        assert set(data) == {VIEW, "image/png", "text/html", "text/plain"}
        # A front end with the widget manager draws the hidden widget there, not the picture.
        anchor = pane._display._anchor
        assert data[VIEW]["model_id"] == anchor.model_id != pane.widget.model_id
        assert (
            anchor.layout.display == "none" and display_module.ANCHOR_CLASS in anchor._dom_classes
        )
        assert LINE.match(data["text/plain"]) and data["text/plain"].endswith("0 events")
        _png(data)
        assert pane._chart._snapshot == _png(data)  # also what a kernel-less view shows
        events.emit("rank_failed", message="rank 1 exited with SIGKILL", rank=1)
        pane.pause()  # a paused pane's picture shows where it stopped, drawn on the worker
        outputs.wait(3)
        kind, data, same_id, thread = outputs.calls[2]
        assert (kind, same_id, thread) == ("update", picture_id, display_module.THREAD_NAME)
        assert VIEW in data and "1 event · paused by the user" in data["text/plain"]
    finally:
        pane.close()
    assert [(c[0], c[2]) for c in outputs.calls[-2:]] == [
        ("update", view_id),
        ("update", picture_id),
    ]
    assert outputs.calls[-2][1] == {"text/plain": ""}  # the live view ended with the pane
    data = outputs.calls[-1][1]
    assert set(data) == {"image/png", "text/html", "text/plain"}  # no hidden widget either
    assert data["text/plain"].endswith("1 event · closed")
    assert pane.snapshot().png == _png(data)
    assert anchor.comm is None and anchor.layout.comm is None  # closed with the pane


def test_polls_never_draw_the_picture_the_worker_does(comms, driven, clock, outputs, monkeypatch):
    sampler = driven()
    drawn: list[str] = []
    real = pane_module.render_png

    def counting(*args, **kwargs):
        drawn.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(pane_module, "render_png", counting)
    monkeypatch.setattr(display_module, "PUSH_AFTER_S", ())
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        pane._display._every = 0.2
        pane._display.show()
        assert len(drawn) == 1
        first = pane._chart._snapshot
        for _ in range(20):
            clock.advance(10)
            sampler.tick()  # the poll path: reading, history, the chart's message
        assert len(drawn) == 1
        deadline = time.monotonic() + 30
        while pane._chart._snapshot == first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drawn[1:] and set(drawn[1:]) == {display_module.THREAD_NAME}
        updates = [c for c in outputs.calls if c[0] == "update"]
        assert {c[2] for c in updates} <= {pane._display.picture_id}  # the live view is not redrawn
    finally:
        pane.close()


def test_plotly_js_is_pushed_twice_per_kernel_and_sent_to_whoever_asks(
    comms, driven, outputs, monkeypatch
):
    driven()
    monkeypatch.setattr(display_module, "PUSH_AFTER_S", (0.0, 0.01))
    monkeypatch.setitem(widget_module._pushes, "left", widget_module.PUSHES)

    def pushes(pane) -> int:
        return sum(
            1
            for m in pane._chart.comm.sent
            if m["data"].get("content", {}).get("k") == "lib" and m["buffers"]
        )

    first = GPUPane(backend=SimulatedBackend(2), display=False)
    second = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        first._display.show()
        deadline = time.monotonic() + 30
        while pushes(first) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        second._display.show()
        time.sleep(0.2)
        assert pushes(first) == 2 and pushes(second) == 0  # its page has first's copy
        second._chart.comm.from_front_end({"method": "custom", "content": {"k": "lib"}})
        assert pushes(second) == 1  # a page without it asked
    finally:
        first.close()
        second.close()


def test_event_ranks_steps_and_pids_are_whole_numbers(comms, driven):
    pd = pytest.importorskip("pandas")
    driven()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        events.emit("rank_failed", message="rank 1 exited", rank=1)
        events.emit("note", message="from the kernel")
        frame = pane.events()
        for column in ("rank", "step", "pid"):
            assert str(frame[column].dtype) == "Int64", column
        assert frame["rank"].iloc[0] == 1 and frame["rank"].iloc[1] is pd.NA
    finally:
        pane.close()


def test_the_name_the_cluster_error_gives_is_importable(comms):
    from nbtools.monitor import ClusterBackend  # where the message says it is

    with pytest.raises(ValueError, match=r"from nbtools\.monitor import ClusterBackend") as err:
        GPUPane(cluster="ray", backend=SimulatedBackend(num_gpus=1), display=False)
    assert "ClusterBackend(simulated=N)" in str(err.value)
    assert ClusterBackend.__name__ == "ClusterBackend"


def test_to_html_writes_the_curves_the_events_and_the_readings(comms, driven, clock, tmp_path):
    sampler = driven()
    for _ in range(10):
        clock.advance(10)
        sampler.tick()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        events.emit("checkpoint_saved", message="saved step_8", step=8, blocked_s=0.3)
        path = pane.to_html(tmp_path / "gpus.html")
        text = (tmp_path / "gpus.html").read_text()
        assert path == str(tmp_path / "gpus.html")
        assert "Plotly.newPlot" in text and "GPU 0" in text and "GPU 1" in text
        assert "checkpoint_saved" in text and "saved step_8" in text
        assert "GPU pane · 2 GPUs (simulated) · last sample" in text
        with pytest.raises(FileNotFoundError, match="does not exist"):
            pane.to_html(tmp_path / "missing" / "gpus.html")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["gpus.html"]
    finally:
        pane.close()


def test_while_a_live_view_watches_the_saved_picture_follows_the_run_by_the_minute(
    comms, driven, clock, outputs, monkeypatch
):
    sampler = driven()
    monkeypatch.setattr(display_module, "PUSH_AFTER_S", ())
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        pane._display._every = 0.2  # SNAPSHOT_EVERY_S, shortened
        pane._display.show()
        view_id, picture_id = pane._display.display_id, pane._display.picture_id
        first = outputs.calls[1][1]
        # A live view on the page: its page holds plotly.js and it is drawing the polls.
        pane._chart.comm.from_front_end({"method": "custom", "content": {"k": "have"}})
        events.emit("note", message="while someone watches")
        for _ in range(3):
            clock.advance(10)
            sampler.tick()
        outputs.wait(3)
        kind, data, same_id, thread = outputs.calls[2]
        assert (kind, same_id, thread) == ("update", picture_id, display_module.THREAD_NAME)
        assert data["text/plain"] != first["text/plain"] and "1 event" in data["text/plain"]
        assert _png(data) != _png(first) and data[VIEW] == first[VIEW]
        assert pane.status == "polling"  # by the minute, not because the pane stopped
        pane.snapshot()  # asked for: the picture now
        assert outputs.calls[-1][:3:2] == ("update", picture_id)
        assert all(c[2] == picture_id for c in outputs.calls[2:])  # never the live view
        assert view_id != picture_id
    finally:
        pane.close()


def _progress(rank: int, steps: int, at: float) -> events.Event:
    return events.Event(
        at, "node-b", rank, 100 + rank, "progress", None, steps, {"steps": steps, "cpu": 0.0}
    )


def test_step_rates_come_from_progress_reports_and_a_silent_rank_drops_to_zero():
    from nbtools.monitor.timeline import step_rates

    reports = [_progress(0, 10 * i, 100.0 + i) for i in range(1, 21)]
    reports += [_progress(1, 5 * i, 100.0 + i) for i in range(1, 6)]  # stops after 105 s
    rates = step_rates(reports)
    assert set(rates) == {0, 1}
    assert rates[0][1][-1] == pytest.approx(10.0)
    assert rates[1][1][:4] == [pytest.approx(5.0)] * 4 and rates[1][1][-1] == 0.0


def test_a_step_rate_spans_what_it_measured_and_none_spans_a_restart():
    from nbtools.monitor.timeline import step_rates

    reports = [_progress(0, 10 * i, 100.0 + i) for i in range(4)]  # 10 steps/s, 100..103 s
    reports += [_progress(0, 1, 110.0), _progress(0, 3, 111.0)]  # restarted: counts from 0
    times, values = step_rates(reports)[0]
    # Every rate from the report before to its own: 100-101, 101-102, 102-103 at 10.
    assert times[:6] == [100.0, 101.0, 101.0, 102.0, 102.0, 103.0]
    assert values[:6] == [pytest.approx(10.0)] * 6
    # Between 103 s and 110 s (the restart) the line is broken, then 110-111 at 2.
    assert times[6:] == [110.0, 110.0, 111.0] and math.isnan(values[6])
    assert values[7:] == [pytest.approx(2.0)] * 2


def test_a_step_rate_is_measured_over_a_second_not_between_two_reports_of_one_burst():
    from nbtools.monitor.timeline import step_rates

    # Rank 0 reports once a second, and twice more around a save (a burst of 3 steps in
    # 30 ms); rank 1, in lockstep, only once a second. Both trained 10 steps a second.
    zero = [_progress(0, s, t) for s, t in [(0, 100.0), (3, 100.02), (5, 100.03)]]
    zero += [_progress(0, 10, 101.0), _progress(0, 20, 102.0)]
    one = [_progress(1, 0, 100.0), _progress(1, 10, 101.0), _progress(1, 20, 102.0)]
    rates = step_rates(zero + one)
    assert rates[0] == rates[1] == ([100.0, 101.0, 101.0, 102.0], [10.0, 10.0, 10.0, 10.0])
    # A report of another process (a restarted rank) starts afresh, whatever its count.
    later = [
        events.Event(105.0, "node-b", 0, 999, "progress", None, 40, {"steps": 40}),
        events.Event(106.0, "node-b", 0, 999, "progress", None, 48, {"steps": 48}),
    ]
    times, values = step_rates(zero + later)[0]
    assert times[4:] == [105.0, 105.0, 106.0] and math.isnan(values[4]) and values[5:] == [8.0] * 2


def _rate_at(series: tuple[list[float], list[float]], at: float) -> float | None:
    """The rate a step line through ``series`` draws at ``at`` (None: nothing drawn there)."""
    times, values = series
    for i in range(0, len(times) - 1):
        if times[i] < at < times[i + 1] and values[i] == values[i + 1]:
            return None if math.isnan(values[i]) else values[i]
    return None


def test_lockstep_ranks_of_the_demo_show_one_rate_and_none_spans_the_restart():
    from _demo_run import demo_events

    from nbtools.monitor.timeline import step_rates

    rates = step_rates(demo_events(1000.0))  # the demo's progress reports, as recorded
    both = 0
    for tenth in range(30, 131):
        at = 1000.0 + tenth / 10
        zero, one = _rate_at(rates[0], at), _rate_at(rates[1], at)
        if zero is not None and one is not None:
            both += 1
            # In lockstep neither rank is a straggler: one rate, give or take a step.
            assert max(zero, one) <= 1.25 * min(zero, one), (at - 1000.0, zero, one)
        if 1008.15 < at < 1009.57:  # from the kill to the restarted ranks' first steps
            assert zero is None and one is None, (at - 1000.0, zero, one)
    assert both >= 30  # while each run trains, both ranks are drawn
    # After the restart both ranks are drawn again, at the pace they really trained.
    assert _rate_at(rates[1], 1010.0) == pytest.approx(12.5, rel=0.05)
    assert _rate_at(rates[0], 1010.0) == pytest.approx(12.5, rel=0.05)


def test_a_process_that_ends_on_a_burst_shows_it_in_its_last_window():
    from nbtools.monitor.timeline import step_rates

    # One report a second at 4 steps/s, then 7 steps in 0.12 s before the rank is killed:
    # the last window joins the one before it rather than standing alone at 58 steps/s.
    reports = [_progress(0, 2, 100.0), _progress(0, 6, 101.2), _progress(0, 13, 101.32)]
    times, values = step_rates(reports)[0]
    assert times == [100.0, 101.32]
    assert values == [pytest.approx(11 / 1.32)] * 2


def test_to_html_without_gpus_shows_step_rates_the_flags_and_a_legend(comms, tmp_path):
    from nbtools.monitor.history import History
    from nbtools.monitor.report import write_html
    from nbtools.monitor.snapshot import PaneState
    from nbtools.monitor.timeline import encode, step_rates

    now = time.time()
    reports = [
        _progress(r, (5 if r == 3 else 10) * i, now - 60 + i)
        for r in range(4)
        for i in range(1, 60)
    ]
    flag = events.Event(
        now - 20,
        "kernel",
        3,
        1,
        "straggler",
        "rank 3 on node-b at 0.50 of the median step rate since 12:04:05",
        50,
        {"node": "node-b", "since": now - 30, "score": 0.5},
    )
    path = write_html(
        tmp_path / "run.html",
        PaneState(History(capacity=10), [encode(flag)], {}, "NVML", rates=step_rates(reports)),
    )
    text = open(path).read()
    assert "Steps per second, by rank" in text and "rank 3 (straggler)" in text
    assert "rank 3 on node-b at 0.50 of the median step rate since 12:04:05" in text
    assert "straggler (rank flagged)" in text  # the legend names the kind of event
    assert "Utilization (%)" not in text and "Temperature" not in text  # no empty GPU charts
    assert "time (local)" in text
