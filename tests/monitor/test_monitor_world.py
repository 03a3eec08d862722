"""The run's world size on the pane: a step line from the launch, down at ``shrunk``, up at ``grew``.

The events are emitted in this process as the launcher and the local backend
emit them (``launch`` with ``world_size``; ``shrunk`` and ``grew`` with
``from_world``, ``to_world``, ``cause``, ``slots``, ``step``, ``tier``); the
pane's front end is a recording comm.
"""

from __future__ import annotations

import io
import time

import pytest

from nbtools import events
from nbtools.monitor import GPUPane, SimulatedBackend
from nbtools.monitor.snapshot import WORLD_TITLE, world_line, world_now, world_summary
from nbtools.monitor.timeline import category, world_sizes

pytest.importorskip("anywidget", reason="the pane's chart needs anywidget")

pytestmark = pytest.mark.usefixtures("clean_bus")

SHRINK_CAUSE = "rank 3 died (SIGKILL) and slot 3 failed to start twice"
SHRUNK = "3 of 4 processes: " + SHRINK_CAUSE + ", from step 4 (live)"
GREW = "4 of 4 processes: slot 3 started again, from step 10 (memory)"


def _poll(sampler, clock, seconds: float = 10) -> None:
    clock.advance(seconds)
    sampler.tick()


def _launch(size: int = 4) -> None:
    """What the launcher emits when a call's first attempt started (``nbtools.launch._runner``)."""
    events.emit("launch", f"{size} ranks (local)", world_size=size, cluster="local", startup_s=1.25)


def _resized(kind: str, sizes: tuple[int, int], cause: str, step: int | None, tier: str) -> None:
    """What the local backend emits when a group goes on with fewer processes, or grew back."""
    before, after = sizes
    went_on = f" from step {step + 1} ({tier})" if step is not None else ""
    events.emit(
        kind,
        f"{cause}: {'continuing on' if kind == 'shrunk' else 'grew to'} {after} processes{went_on}",
        from_world=before,
        to_world=after,
        cause=cause,
        slots="3",
        step=step,
        tier=tier if step is not None else None,
        attempt=2,
        seconds=0.41,
    )


def _shrunk(step: int | None = 3) -> None:
    _resized("shrunk", (4, 3), SHRINK_CAUSE, step, "live")


def _grew() -> None:
    _resized("grew", (3, 4), "slot 3 started again", 9, "memory")


def _figure(chart) -> dict:
    return chart.sent[-1]["data"]["state"]["_figure"]


def test_a_run_that_never_changed_size_draws_no_world_row_and_polls_stay_small(
    comms, driven, clock
):
    sampler = driven()
    _launch()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        figure = chart.opened_state()["_figure"]
        assert figure["wi"] == -1 and figure["wx"] == [] and not figure["wl"]
        titles = [a["text"] for a in figure["layout"]["annotations"]]
        assert WORLD_TITLE not in titles
        events.emit("finished", "4 ranks returned", seconds=12.0, restarts=0)
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["k"] == "s"  # a poll, not a new figure
    finally:
        pane.close()


def test_the_world_size_steps_down_at_shrunk_and_up_at_grew_with_the_cause_and_step(
    comms, driven, clock
):
    sampler = driven()
    _launch()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        chart = pane._chart.comm
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["k"] == "s"
        _shrunk()
        _poll(sampler, clock)
        figure = _figure(chart)  # the row is new: the whole figure comes again
        launched, shrunk = (e.time for e in events.log(kinds=["launch", "shrunk"]))
        titles = [a["text"] for a in figure["layout"]["annotations"]]
        assert titles[-1] == WORLD_TITLE
        line = figure["data"][figure["wi"]]
        assert line["line"]["shape"] == "hv" and line["yaxis"] == "y4"
        assert figure["wx"][:2] == [round(launched * 1000), round(shrunk * 1000)]
        assert figure["wy"] == [4, 3, 3]  # the last point carries the line on to now
        assert figure["wt"] == ["4 processes at launch", SHRUNK, SHRUNK]
        assert figure["wl"] is True and figure["wx"][2] >= figure["wx"][1]
        # The shrink is an event of its own on the time axis, with its line across the rows.
        (row,) = [r for r in figure["ev"] if r[1] == "shrunk"]
        assert row[2] == category("shrunk") == "world" and row[4] == 3
        # Polls after it are small again: the line holds until the next change.
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["k"] == "s"
        _grew()
        _poll(sampler, clock)
        figure = _figure(chart)
        assert figure["wy"] == [4, 3, 4, 4]
        assert figure["wt"][2] == GREW
        _poll(sampler, clock)
        assert chart.custom_messages()[-1]["k"] == "s"
        # The run ends: the line stops there (a break), and polls no longer carry it on.
        events.emit("finished", "4 ranks returned", seconds=30.0, restarts=2)
        _poll(sampler, clock)
        figure = _figure(chart)
        assert figure["wy"][-2:] == [4, None] and figure["wl"] is False
        assert figure["wt"][-2] == "4 of 4 processes: finished"
    finally:
        pane.close()


def test_without_gpus_the_world_row_is_the_pane_and_the_events_mark_its_top(comms, fake_pynvml):
    fake_pynvml([], init_error="NVMLError_DriverNotLoaded")
    _launch()
    _shrunk(step=None)  # it went on from the function's start: no checkpoint yet
    pane = GPUPane(display=False)
    try:
        figure = pane._chart.comm.opened_state()["_figure"]
        assert [a["text"] for a in figure["layout"]["annotations"]] == [WORLD_TITLE]
        assert figure["ey"] == ["y2", 1] and figure["layout"]["yaxis2"]["overlaying"] == "y"
        assert figure["wy"][:2] == [4, 3]
        assert figure["wt"][1] == f"3 of 4 processes: {SHRINK_CAUSE}, from the function's start"
    finally:
        pane.close()


def test_the_picture_the_text_and_the_html_report_show_the_world_size(
    comms, driven, clock, tmp_path
):
    from PIL import Image

    sampler = driven()
    for _ in range(5):
        _poll(sampler, clock)
    _launch()
    pane = GPUPane(backend=SimulatedBackend(2), display=False)
    try:
        flat = pane.snapshot()
        assert "processes" not in flat.text
        _shrunk()
        shrunk = pane.snapshot()
        at = time.strftime("%H:%M:%S", time.localtime(events.log(kinds=["shrunk"])[0].time))
        assert shrunk.text.endswith(f"· 2 events · 3 of 4 processes since {at}")
        # The picture has a row more: the world size's.
        before = Image.open(io.BytesIO(flat.png)).size
        after = Image.open(io.BytesIO(shrunk.png)).size
        assert after[0] == before[0] and after[1] > before[1]
        pane.to_html(tmp_path / "gpus.html")
        text = (tmp_path / "gpus.html").read_text()
        assert WORLD_TITLE in text and "3 of 4 processes since" in text
        assert SHRINK_CAUSE in text and "from step 4 (live)" in text
    finally:
        pane.close()


def _event(at: float, kind: str, step: int | None = None, **fields) -> events.Event:
    return events.Event(at, "kernel", None, 1, kind, None, step, fields)


def test_the_line_from_events_alone():
    launch = _event(100.0, "launch", world_size=8)
    shrunk = _event(
        160.0, "shrunk", 41, from_world=8, to_world=5, cause="GPU 5 lost (Xid 79)", tier="memory"
    )
    grew = _event(400.0, "grew", 99, from_world=5, to_world=8, cause="GPU 5 back")
    assert world_sizes([launch, _event(150.0, "eval")]) == []  # no change: nothing drawn
    steps = world_sizes([grew, shrunk, launch])  # in any order
    assert [(s.time, s.size) for s in steps] == [(100.0, 8), (160.0, 5), (400.0, 8)]
    assert steps[1].text == "5 of 8 processes: GPU 5 lost (Xid 79), from step 42 (memory)"
    assert steps[2].text == "8 of 8 processes: GPU 5 back, from step 100"
    # The launch fell out of the history: the line starts at the shrink's size before it.
    early = world_sizes([shrunk])
    assert [(s.time, s.size) for s in early] == [(160.0, 8), (160.0, 5)]
    assert early[0].text == "8 of 8 processes before"
    # As a polyline for the picture: held flat until each change, then carried on to "now".
    times, values = world_line(world_now(steps, until=500.0))
    assert times == [100.0, 160.0, 160.0, 400.0, 400.0, 500.0, 500.0]
    assert values == [8.0, 8.0, 5.0, 5.0, 8.0, 8.0, 8.0]
    # A finished run ends the line; a summary says nothing of a run that is over.
    over = world_sizes([launch, shrunk, _event(450.0, "finished")])
    assert [s.size for s in over][-2:] == [5, None] and world_summary(over) == ""
    assert world_now(over, until=500.0) == over
