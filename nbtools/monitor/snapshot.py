"""A still picture of the GPU pane, for saved, shared and exported notebooks.

:func:`render_png` draws what the live pane shows (the latest readings, the
utilization, memory and temperature curves of every GPU, the run's events on
the same time axis) as one PNG at reduced resolution (at most
``MAX_POINTS`` points per line), drawn with Pillow: no browser, no display,
no JavaScript to show it. :func:`summary` is the same state as plain text,
one line per host. A :class:`PaneState` is what the pane shows at one moment; the
picture here and the HTML report (:func:`nbtools.monitor.report.write_html`) both
draw one.

Why Pillow: plotly's static export (kaleido) drives a headless browser, which
a training image seldom has; matplotlib takes about a second for this figure
on a busy machine, Pillow well under 200 ms. A PNG renders everywhere a
notebook is shown (GitHub, nbviewer, nbconvert, VS Code), where inline SVG in
HTML may be sanitised away.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nbtools.monitor.history import History
from nbtools.monitor.readings import MIG_BASE

__all__ = [
    "COLORS",
    "gpu_label",
    "MAX_POINTS",
    "PaneState",
    "STYLE",
    "Snapshot",
    "readings_table",
    "render_png",
    "summary",
    "WORLD_TITLE",
    "world_line",
    "world_now",
    "world_row",
    "world_summary",
]

#: Most points drawn per line (bucket means of the history).
MAX_POINTS = 360
_GIB = 1024**3
#: Line colours by rank or GPU index, shared by the live pane, the report and the still picture.
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_DASHES = ("-", ":", "--", "-.")
_PANELS = (
    ("utilization", 1.0, "Utilization (%)"),
    ("memory_used", 1.0 / _GIB, "Memory used (GiB)"),
    ("temperature", 1.0, "Temperature (°C)"),
)
#: How each category of event is drawn (the live chart uses the same colours):
#: colour, marker, band opacity (a span) or line style (a vertical line).
STYLE: dict[str, dict[str, Any]] = {
    "save": {"color": "#2563eb", "marker": "s", "band": 0.22},
    "stall": {"color": "#d97706", "marker": "D", "band": 0.18},
    "failure": {"color": "#dc2626", "marker": "x", "line": "-"},
    "restart": {"color": "#ea580c", "marker": "^", "line": "--"},
    "restore": {"color": "#16a34a", "marker": ">", "band": 0.3},
    "phase": {"color": "#334155", "marker": "d", "line": "--"},
    "run": {"color": "#6b7280", "marker": "o", "line": ":"},
    "world": {"color": "#0f766e", "marker": "s", "line": "-."},
    "hang": {"color": "#b91c1c", "marker": "x", "band": 0.25},
    "straggler": {"color": "#ca8a04", "marker": "D", "band": 0.2},
    "mark": {"color": "#7c3aed", "marker": "v"},
}
_LISTED = 6
#: The world size's row, in the live chart, the picture and the report.
WORLD_TITLE = "Processes (world size)"


@dataclass(frozen=True)
class PaneState:
    """What the pane shows at one moment, as the still picture and the HTML report draw it.

    Attributes:
        history: The samples to draw.
        events: Event rows as the chart gets them (``[ms, kind, category, rank,
            step, start ms, text]``, see :func:`nbtools.monitor.timeline.encode`).
        latest: ``(host, index) -> GPUReading``: the values of the table.
        source: ``"NVML"`` or ``"simulated"`` (said in the title).
        status: The pane's status in words (under the title).
        rates: ``rank -> (times, steps per second)``: a panel of step rates,
            above the GPU panels (which are left out when there are no GPUs).
        world: The run's world size over time, the
            :class:`~nbtools.monitor.timeline.WorldStep` of
            :func:`~nbtools.monitor.timeline.world_sizes`: a low panel under the
            others when it changed; empty draws none.
    """

    history: History
    events: Sequence[Sequence[Any]]
    latest: dict[Any, Any]
    source: str
    status: str = ""
    rates: dict[int, tuple[list[float], list[float]]] | None = None
    world: Sequence[Any] = ()


@dataclass(frozen=True)
class Snapshot:
    """One still picture of a pane: the PNG, its one-line-per-host text, when it was taken.

    Shown in a notebook cell, it is the picture.
    """

    png: bytes
    text: str
    time: float

    def _repr_png_(self) -> bytes:
        return self.png

    def __repr__(self) -> str:
        return f"<Snapshot {len(self.png)} bytes PNG · {self.text.splitlines()[0] if self.text else ''}>"


def gpu_label(index: int) -> str:
    """How a row is named: ``"GPU 3"``, or ``"GPU 3 · MIG 1"`` for a MIG device."""
    if index < MIG_BASE:
        return f"GPU {index}"
    return f"GPU {index // MIG_BASE - 1} · MIG {index % MIG_BASE}"


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))


def _reduced(stamps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """At most ``MAX_POINTS`` bucket means; a bucket with no value stays a gap (NaN)."""
    n = len(stamps)
    if n <= MAX_POINTS:
        return stamps, values
    edges = np.linspace(0, n, MAX_POINTS + 1).astype(int)
    times = np.add.reduceat(stamps, edges[:-1]) / np.diff(edges)
    ok = ~np.isnan(values)
    sums = np.add.reduceat(np.where(ok, values, 0.0), edges[:-1])
    counts = np.add.reduceat(ok.astype(float), edges[:-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        return times, np.where(counts > 0, sums / counts, np.nan)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def readings_table(
    gpus: Sequence[tuple[str, int, str]], latest: dict[Any, Any]
) -> list[tuple[str, ...]]:
    """The latest readings as text cells: a header row, then one row per GPU that has a reading.

    Args:
        gpus: ``(host, index, name)`` of every GPU, in the pane's order.
        latest: ``(host, index) -> GPUReading``.
    """
    rows: list[tuple[str, ...]] = [("GPU", "Util %", "Memory GiB", "Temp °C", "Power W", "Name")]
    for host, index, name in gpus:
        r = latest.get((host, index))
        if r is None:
            continue
        used = None if r.memory_used is None else r.memory_used / _GIB
        total = None if r.memory_total is None else r.memory_total / _GIB
        power = _fmt(r.power) + (f" / {_fmt(r.power_limit)}" if r.power_limit else "")
        rows.append(
            (
                f"{host} · {gpu_label(index).removeprefix('GPU ')}",
                _fmt(r.utilization),
                f"{_fmt(used, 1)} / {_fmt(total)}",
                _fmt(r.temperature),
                power,
                f"{name} ({r.problem})" if getattr(r, "problem", "") else name,
            )
        )
    return rows


def render_png(state: PaneState) -> bytes:
    """The pane as a PNG: readings table, three panels of curves, the events, the newest listed.

    Returns:
        The PNG's bytes: 1000 pixels wide, a palette of at most 64 colours
        (tens of KB).
    """
    from nbtools.monitor._still import Canvas

    history, events, latest, source = state.history, state.events, state.latest, state.source
    status, rates = state.status, state.rates

    gpus = history.gpus()
    hosts = history.hosts()
    series = {}
    for host, index, _name in gpus:
        for field, scale, _label in _PANELS:
            stamps, values = history.series(host, index, field)
            series[(host, index, field)] = _reduced(stamps, values * scale)
    table = readings_table(gpus, latest)
    listed = list(events)[-_LISTED:]
    world = list(state.world)
    panels: list[tuple[str, float, str]] = list(_PANELS) if gpus or not (rates or world) else []
    if rates:
        panels.insert(0, ("steps", 1.0, "Steps per second, by rank (flagged ranks bold)"))
    if world:
        panels.append(("world", 1.0, WORLD_TITLE))
    canvas = Canvas(width=1000, rows=len(table), listed=len(listed) + 1, panels=len(panels))
    simulated = source == "simulated"
    canvas.title(
        "GPU resources" + (" · SIMULATED GPUs (made-up numbers)" if simulated else f" · {source}"),
        warn=simulated,
    )
    canvas.status(status)
    canvas.table(table)
    rate_times = [np.asarray(t, dtype=float) for t, _v in (rates or {}).values() if t]
    world_times = [np.asarray([s.time for s in world], dtype=float)] if world else []
    span = _span([x for x, _ in series.values() if len(x)] + rate_times + world_times, events)
    canvas.legend(
        [
            (
                f"{h} · {gpu_label(i)}" if len(hosts) > 1 else gpu_label(i),
                COLORS[i % len(COLORS)],
                hosts.index(h) % 2 == 1,
            )
            for h, i, _ in gpus
        ]
        + [(f"rank {r}", COLORS[r % len(COLORS)], False) for r in sorted(rates or {})]
    )
    memory_top = (
        max([_GIB] + [getattr(latest.get((h, i)), "memory_total", 0) or 0 for h, i, _ in gpus])
        / _GIB
    )
    flagged = {e[3] for e in events if e[2] in ("hang", "straggler")}
    for panel, (field, _scale, label) in enumerate(panels):
        if field == "utilization":
            low, high = 0.0, 105.0
        elif field == "memory_used":
            low, high = 0.0, memory_top * 1.05
        elif field == "steps":
            top = max((float(np.nanmax(v)) for _t, v in (rates or {}).values() if v), default=1.0)
            low, high = 0.0, max(top, 1e-3) * 1.1
        elif field == "world":
            low, high = 0.0, max(s.size or 0 for s in world) + 0.5
        else:
            low, high = _range([y for (_h, _i, f), (_x, y) in series.items() if f == field])
        empty = not gpus and field not in ("steps", "world")
        box = canvas.panel(panel, label, span, (low, high), empty=empty)
        for e in events:
            style = STYLE.get(e[2], STYLE["mark"])
            if style.get("band") and e[5] is not None:
                box.band(e[5] / 1000, e[0] / 1000, style["color"], style["band"])
            elif style.get("line"):
                box.vline(e[0] / 1000, style["color"], style["line"])
        if field == "steps":
            for rank, (at, rate) in sorted((rates or {}).items()):
                color = COLORS[rank % len(COLORS)]
                xs, ys = np.asarray(at, dtype=float), np.asarray(rate, dtype=float)
                box.line(xs, ys, color)
                if rank in flagged:  # drawn twice, a pixel apart: bold
                    box.line(xs, ys + (high - low) / 150, color)
        elif field == "world":
            at, size = world_line(world_now(world, span[1]))
            box.line(np.asarray(at), np.asarray(size), STYLE["world"]["color"])
        else:
            for host, index, _name in gpus:
                x, y = series[(host, index, field)]
                box.line(x, y, COLORS[index % len(COLORS)], dashed=hosts.index(host) % 2 == 1)
        if panel == 0:
            for e in events:
                style = STYLE.get(e[2], STYLE["mark"])
                box.marker(e[0] / 1000, style["color"], style["marker"])
    canvas.time_axis(span)
    lines = []
    for e in reversed(listed):
        detail = " · ".join(
            p
            for p in (
                None if e[3] is None else f"rank {e[3]}",
                None if e[4] is None else f"step {e[4]}",
                e[6],
            )
            if p
        )
        lines.append((_clock(e[0] / 1000), e[1], detail, STYLE.get(e[2], STYLE["mark"])["color"]))
    canvas.events(lines, total=len(events))
    return canvas.png()


def world_now(steps: Sequence[Any], until: float | None = None) -> list[Any]:
    """``steps`` with the line carried on to ``until`` (default now) while the run goes on."""
    if not steps or steps[-1].size is None:
        return list(steps)
    last = steps[-1]
    until = time.time() if until is None else until
    if until <= last.time:
        return list(steps)
    return [*steps, dataclasses.replace(last, time=until)]


def world_row(fig: Any, row: int, steps: Sequence[Any], **data: Any) -> None:
    """Add the world size's step line to row ``row`` of the plotly figure ``fig`` (the live
    chart's and the report's), with its value axis; ``data``: the trace's points, if any."""
    fig.add_scatter(
        row=row,
        col=1,
        mode="lines",
        name="processes",
        showlegend=False,
        hovertemplate="%{customdata}<extra>world size</extra>",
        line={"color": STYLE["world"]["color"], "width": 2, "shape": "hv"},
        **data,
    )
    top = max(s.size or 0 for s in steps)
    fig.update_yaxes(range=[0, top + 0.5], tickformat="d", fixedrange=True, row=row, col=1)


def world_line(steps: Sequence[Any]) -> tuple[list[float], list[float]]:
    """The step line as a polyline (seconds, processes; NaN breaks it) for a still picture."""
    times: list[float] = []
    values: list[float] = []
    for step in steps:
        if step.size is not None and values and not math.isnan(values[-1]):
            times.append(step.time)  # the last size holds until this step
            values.append(values[-1])
        times.append(step.time)
        values.append(math.nan if step.size is None else float(step.size))
    return times, values


def world_summary(steps: Sequence[Any]) -> str:
    """The size now in words, and since when (``"3 of 4 processes since 12:04:31"``);
    empty when nothing is drawn or the run finished."""
    if not steps or steps[-1].size is None:
        return ""
    since, size = steps[0].time, steps[0].size
    for step in steps[1:]:
        if step.size != size:
            since, size = step.time, step.size
    words = steps[-1].text.split(":")[0].removesuffix(" at launch")
    return f"{words} since {time.strftime('%H:%M:%S', time.localtime(since))}"


def _span(times: list[np.ndarray], events: Sequence[Sequence[Any]]) -> tuple[float, float]:
    """The time axis: the samples' span, stretched to later events (a paused pane still hears)."""
    stamps = np.concatenate(times) if times else np.array([])
    stamps = stamps[~np.isnan(stamps)]
    marks = [e[0] / 1000 for e in events]
    if len(stamps):
        low, high = float(stamps.min()), float(stamps.max())
        high = max([high] + [t for t in marks if t > high])
    elif marks:
        low, high = min(marks + [e[5] / 1000 for e in events if e[5] is not None]), max(marks)
    else:
        high = time.time()
        low = high - 60.0
    return min(low, high - 60.0), high


def _range(columns: list[np.ndarray]) -> tuple[float, float]:
    values = np.concatenate(columns) if columns else np.array([])
    values = values[~np.isnan(values)] if len(values) else values
    if not len(values):
        return 0.0, 100.0
    low = max(0.0, math.floor((values.min() - 5) / 10) * 10)
    return low, max(low + 10, math.ceil((values.max() + 5) / 10) * 10)


def summary(
    history: History,
    latest: dict[Any, Any],
    source: str,
    *,
    events: int = 0,
    status: str = "",
    world: str = "",
) -> str:
    """The pane in plain text, one line per host.

    ``world`` is the run's world size in words when it changed
    (:func:`world_summary`).

    Example:
        ``GPU pane · 2 GPUs (simulated) · last sample 12:04:31 · util 94 % / 71 % · 3 events``
    """
    gpus = history.gpus()
    hosts = history.hosts()
    tail = f" · {events} event{'s' if events != 1 else ''}"
    if world:
        tail += f" · {world}"
    if status:
        tail += f" · {status}"
    if not gpus:
        return f"GPU pane · no GPU reading ({source})" + tail
    lines = []
    for host in hosts:
        mine = [(h, i) for h, i, _ in gpus if h == host]
        readings = [latest.get(key) for key in mine]
        utils = " / ".join(f"{_fmt(getattr(r, 'utilization', None))} %" for r in readings)
        stamps, _ = history.series(*mine[0], "utilization")
        last = f" · last sample {_clock(stamps[-1])}" if len(stamps) else ""
        where = f" · {host}" if len(hosts) > 1 else ""
        count = f"{len(mine)} GPU{'s' if len(mine) != 1 else ''}"
        lines.append(f"GPU pane{where} · {count} ({source}){last} · util {utils}{tail}")
    return "\n".join(lines)
