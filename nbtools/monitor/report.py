"""The GPU pane as one standalone HTML file: the curves, the events, the latest readings.

:func:`write_html` is what ``GPUPane.to_html(path)`` writes: a plotly figure
(utilization, memory and temperature of every GPU over the pane's history,
the run's events drawn the way the live pane draws them) with plotly.js inside
the file, so it opens anywhere without a network, e.g. as a run's MLflow
artifact; then the readings table and the list of events as plain HTML.
"""

from __future__ import annotations

import html
import math
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from nbtools.monitor.history import History
from nbtools.monitor.snapshot import COLORS as _COLORS
from nbtools.monitor.snapshot import (
    WORLD_TITLE,
    PaneState,
    gpu_label,
    readings_table,
    summary,
    world_now,
    world_row,
    world_summary,
)
from nbtools.monitor.timeline import CATEGORY_LABELS, WorldStep

__all__ = ["timeline_figure", "write_html"]

_GIB = 1024**3
_PANELS = (
    ("utilization", 1.0, "Utilization (%)"),
    ("memory_used", 1.0 / _GIB, "Memory used (GiB)"),
    ("temperature", 1.0, "Temperature (°C)"),
)
_DASHES = ("solid", "dot", "dash", "longdash", "dashdot")
# The live chart's styles (nbtools/monitor/_chart.js).
_STYLE: dict[str, dict[str, Any]] = {
    "save": {"color": "#2563eb", "symbol": "square", "band": 0.22},
    "stall": {"color": "#d97706", "symbol": "diamond", "band": 0.18},
    "failure": {"color": "#dc2626", "symbol": "x", "line": "solid"},
    "restart": {"color": "#ea580c", "symbol": "triangle-up", "line": "dash"},
    "restore": {"color": "#16a34a", "symbol": "triangle-right", "band": 0.3},
    "phase": {"color": "#334155", "symbol": "diamond-tall", "line": "longdash"},
    "run": {"color": "#6b7280", "symbol": "circle-open", "line": "dot"},
    "world": {"color": "#0f766e", "symbol": "square-open", "line": "dashdot"},
    "hang": {"color": "#b91c1c", "symbol": "hexagram", "band": 0.25},
    "straggler": {"color": "#ca8a04", "symbol": "star", "band": 0.2},
    "mark": {"color": "#7c3aed", "symbol": "triangle-down"},
}


def _local(ms: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) + f".{int(ms % 1000):03d}"


def _detail(row: Sequence[Any]) -> str:
    parts = [
        None if row[3] is None else f"rank {row[3]}",
        None if row[4] is None else f"step {row[4]}",
        row[6] or None,
    ]
    return " · ".join(p for p in parts if p)


def _has_data(history: History, field: str) -> bool:
    for host, index, _name in history.gpus():
        _stamps, values = history.series(host, index, field)
        if values.size and not np.isnan(values).all():
            return True
    return False


def timeline_figure(
    history: History,
    events: Sequence[Sequence[Any]],
    source: str,
    rates: dict[int, tuple[list[float], list[float]]] | None = None,
    world: Sequence[WorldStep] = (),
) -> Any:
    """A plotly figure on one time axis: events, step rate per rank, every GPU's curves.

    Rows: a lane of events (one legend entry per kind of event), the step rate
    of each rank (when ranks reported progress; flagged ranks drawn bold),
    then utilization, memory and temperature, each only when some GPU has data
    (a run without GPUs shows no empty GPU charts), then the run's world size
    when it changed (a step line; its hover says why and from which step). Every row has time labels. The
    events' lines and bands cross the rows below the lane (the lane's markers say
    the same), and each phase's name stands beside its marker in the lane, where
    nothing runs through it.

    Args:
        history: The samples.
        events: Event rows (``[ms, kind, category, rank, step, start ms, text]``).
        source: ``"NVML"`` or ``"simulated"`` (said in the title).
        rates: ``rank -> (times, steps per second)`` (:func:`~nbtools.monitor.timeline.step_rates`).
        world: The world size's steps (:func:`~nbtools.monitor.timeline.world_sizes`).
    """
    from plotly.subplots import make_subplots

    gpus, hosts = history.gpus(), history.hosts()
    panels = [p for p in _PANELS if _has_data(history, p[0])]
    titles = ["Events"] + (["Steps per second, by rank"] if rates else [])
    titles += [label for _f, _s, label in panels]
    heights = [0.5] + [1.0] * (len(titles) - 1)
    if world:
        titles.append(WORLD_TITLE)
        heights.append(0.45)
    fig = make_subplots(
        rows=len(titles),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=titles,
        row_heights=heights,
    )
    flagged = {row[3]: row[2] for row in events if row[2] in ("hang", "straggler")}
    row_at = 2
    if rates:
        for rank, (when, rate) in sorted(rates.items()):
            label = f"rank {rank}" + (f" ({flagged[rank]})" if rank in flagged else "")
            fig.add_scatter(
                row=row_at,
                col=1,
                mode="lines",
                name=label,
                legendgroup=label,
                x=[_local(t * 1000) for t in when],
                y=[None if math.isnan(v) else round(v, 3) for v in rate],
                line={
                    "color": _COLORS[rank % len(_COLORS)],
                    "width": 3.5 if rank in flagged else 1.5,
                },
                hovertemplate=f"%{{y}} steps/s<extra>{label}</extra>",
            )
        fig.update_yaxes(rangemode="tozero", row=row_at, col=1)
        row_at += 1
    for offset, (field, scale, _label) in enumerate(panels):
        for host, index, name in gpus:
            stamps, values = history.series(host, index, field)
            label = f"{host} · {gpu_label(index)}" if len(hosts) > 1 else gpu_label(index)
            fig.add_scatter(
                row=row_at + offset,
                col=1,
                mode="lines",
                name=label,
                legendgroup=label,
                showlegend=offset == 0,
                hovertemplate=f"{name}<br>%{{y}}<extra>{label}</extra>",
                x=[_local(t * 1000) for t in stamps.tolist()],
                y=np.where(np.isnan(values), None, np.round(values * scale, 2)).tolist(),
                line={
                    "color": _COLORS[index % len(_COLORS)],
                    "dash": _DASHES[hosts.index(host) % len(_DASHES)],
                    "width": 1.5,
                },
            )
        if field == "utilization":
            fig.update_yaxes(range=[0, 105], row=row_at + offset, col=1)
    if world:
        line = world_now(world)
        world_row(
            fig,
            len(titles),
            world,
            x=[_local(s.time * 1000) for s in line],
            y=[s.size for s in line],
            customdata=[html.escape(s.text) for s in line],
        )
    # Lines and bands cross the rows below the events' lane, whose markers say the same: the
    # lane keeps room for the phases' names, which no line or band runs through.
    shape_rows = list(range(2, len(titles) + 1)) or [1]
    lanes: dict[str, tuple[list, list]] = {}
    for row in events:
        style = _STYLE.get(row[2], _STYLE["mark"])
        at = _local(row[0])
        if style.get("band") and row[5] is not None:
            for shape_row in shape_rows:
                fig.add_vrect(
                    x0=_local(row[5]),
                    x1=at,
                    fillcolor=style["color"],
                    opacity=style["band"],
                    layer="below",
                    line_width=1,
                    line_color=style["color"],
                    row=shape_row,
                    col=1,
                )
        elif style.get("line"):
            for shape_row in shape_rows:
                fig.add_vline(
                    x=at,
                    line={"color": style["color"], "width": 1.5, "dash": style["line"]},
                    row=shape_row,
                    col=1,
                )
        if row[2] == "phase" and row[6]:  # its name beside its marker, in the phases' lane
            fig.add_annotation(
                x=at,
                xref="x",
                y=CATEGORY_LABELS["phase"],
                yref="y",
                text=html.escape(row[6]),
                showarrow=False,
                xanchor="left",
                yanchor="middle",
                xshift=9,
                font={"size": 12, "color": style["color"]},
                bgcolor="rgba(255,255,255,0.8)",
            )
        xs, texts = lanes.setdefault(row[2] if row[2] in _STYLE else "mark", ([], []))
        xs.append(at)
        texts.append(f"<b>{html.escape(row[1])}</b> {at[11:19]}<br>{html.escape(_detail(row))}")
    for cat, (xs, texts) in lanes.items():
        style = _STYLE[cat]
        fig.add_scatter(
            row=1,
            col=1,
            mode="markers",
            name=CATEGORY_LABELS.get(cat, cat),
            legendgroup="events",
            legendgrouptitle_text="Events",
            x=xs,
            y=[CATEGORY_LABELS.get(cat, cat)] * len(xs),
            customdata=texts,
            hovertemplate="%{customdata}<extra></extra>",
            cliponaxis=False,
            marker={
                "color": style["color"],
                "symbol": style["symbol"],
                "size": 10,
                "line": {"width": 1, "color": "white"},
            },
        )
    title = "Training run" + (" and GPU resources" if panels else " (no GPU readings)")
    title += " (SIMULATED GPUs, made-up numbers)" if source == "simulated" and panels else ""
    fig.update_layout(
        paper_bgcolor="white",
        plot_bgcolor="white",
        font={"color": "#2a3f5f"},
        height=160 + 190 * len(titles),
        margin={"l": 150, "r": 20, "t": 70, "b": 40},
        title={"text": title, "x": 0.01},
        legend={"groupclick": "toggleitem"},
        hovermode="closest",
    )
    fig.update_yaxes(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8")
    fig.update_xaxes(type="date", gridcolor="#EBF0F8", showticklabels=True, tickformat="%H:%M:%S")
    fig.update_xaxes(title_text="time (local)", row=len(titles), col=1)
    return fig


def _table(gpus: Sequence[tuple[str, int, str]], latest: dict) -> str:
    head, *body = readings_table(gpus, latest)

    def row(cells: Sequence[str], tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    return (
        "<table class='readings'>"
        + row(head, "th")
        + "".join(row(r, "td") for r in body)
        + "</table>"
    )


def write_html(path: str | os.PathLike[str], state: PaneState) -> str:
    """Write the pane's curves, events and readings to ``path`` (atomically); returns the path.

    Raises:
        FileNotFoundError: The directory of ``path`` does not exist.
    """
    history, events, latest, source = state.history, state.events, state.latest, state.source
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"cannot write {path}: the directory {folder} does not exist; "
            "create it first or pick another path"
        )
    figure = timeline_figure(history, events, source, state.rates, state.world).to_html(
        include_plotlyjs=True, full_html=False, config={"displaylogo": False}
    )
    listed = "".join(
        f"<tr><td>{html.escape(_local(r[0])[:19])}</td><td>{html.escape(r[1])}</td>"
        f"<td>{html.escape(_detail(r))}</td></tr>"
        for r in reversed(list(events))
    )
    text = summary(
        history,
        latest,
        source,
        events=len(events),
        status=state.status,
        world=world_summary(world_now(state.world)),
    )
    table = _table(history.gpus(), latest) if history.gpus() else ""  # no empty table on CPU
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>GPU pane</title><style>"
        "body{font-family:sans-serif;font-size:13px;color:#2a3f5f;margin:16px}"
        "table{border-collapse:collapse;margin:6px 0 14px}td,th{padding:2px 12px 2px 0;"
        "text-align:left}th{color:#666}</style></head><body>"
        f"<pre class='summary'>{html.escape(text)}</pre>{table}{figure}"
        f"<h3>Events ({len(events)})</h3><table class='events'>{listed}</table></body></html>"
    )
    fd, tmp = tempfile.mkstemp(prefix=".gpu-pane-", suffix=".html", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(page)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is for sharing
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
