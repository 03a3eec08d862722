"""The GPU pane as one standalone HTML file: the curves, the events, the latest readings.

:func:`write_html` is what ``GPUPane.to_html(path)`` writes: a plotly figure
(utilization, memory and temperature of every GPU over the pane's history,
the run's events drawn the way the live pane draws them) with plotly.js inside
the file, so it opens anywhere without a network, e.g. as a run's MLflow
artifact; then the readings table and the list of events as plain HTML.
"""

from __future__ import annotations

import html
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from nbtools.monitor.history import History
from nbtools.monitor.snapshot import readings_table, summary

__all__ = ["timeline_figure", "write_html"]

_GIB = 1024**3
_PANELS = (("utilization", 1.0, "Utilization (%)"), ("memory_used", 1.0 / _GIB, "Memory used (GiB)"),
           ("temperature", 1.0, "Temperature (°C)"))
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
_DASHES = ("solid", "dot", "dash", "longdash", "dashdot")
# The live chart's styles (nbtools/monitor/_chart.js).
_STYLE: dict[str, dict[str, Any]] = {
    "save": {"color": "#2563eb", "symbol": "square", "band": 0.22},
    "stall": {"color": "#d97706", "symbol": "diamond", "band": 0.18},
    "failure": {"color": "#dc2626", "symbol": "x", "line": "solid"},
    "restart": {"color": "#ea580c", "symbol": "triangle-up", "line": "dash"},
    "run": {"color": "#6b7280", "symbol": "circle-open", "line": "dot"},
    "mark": {"color": "#7c3aed", "symbol": "triangle-down"},
}


def _local(ms: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) + f".{int(ms % 1000):03d}"


def _detail(row: Sequence[Any]) -> str:
    parts = [None if row[3] is None else f"rank {row[3]}", None if row[4] is None else f"step {row[4]}",
             row[6] or None]
    return " · ".join(p for p in parts if p)


def timeline_figure(history: History, events: Sequence[Sequence[Any]], source: str) -> Any:
    """A plotly figure: three panels of every GPU's curves, the events on the shared time axis.

    Args:
        history: The samples.
        events: Event rows (``[ms, kind, category, rank, step, start ms, text]``).
        source: ``"NVML"`` or ``"simulated"`` (said in the title).
    """
    from plotly.subplots import make_subplots

    gpus, hosts = history.gpus(), history.hosts()
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=[label for _f, _s, label in _PANELS])
    for panel, (field, scale, _label) in enumerate(_PANELS):
        for host, index, name in gpus:
            stamps, values = history.series(host, index, field)
            label = f"{host} · GPU {index}" if len(hosts) > 1 else f"GPU {index}"
            fig.add_scatter(
                row=panel + 1, col=1, mode="lines", name=label, legendgroup=label,
                showlegend=panel == 0, hovertemplate=f"{name}<br>%{{y}}<extra>{label}</extra>",
                x=[_local(t * 1000) for t in stamps.tolist()],
                y=np.where(np.isnan(values), None, np.round(values * scale, 2)).tolist(),
                line={"color": _COLORS[index % len(_COLORS)],
                      "dash": _DASHES[hosts.index(host) % len(_DASHES)], "width": 1.5},
            )
    xs, texts, colors, symbols = [], [], [], []
    for row in events:
        style = _STYLE.get(row[2], _STYLE["mark"])
        at = _local(row[0])
        if style.get("band") and row[5] is not None:
            fig.add_vrect(x0=_local(row[5]), x1=at, fillcolor=style["color"], opacity=style["band"],
                          layer="below", line_width=1, line_color=style["color"])
        elif style.get("line"):
            fig.add_vline(x=at, line={"color": style["color"], "width": 1.5, "dash": style["line"]})
        xs.append(at)
        texts.append(f"<b>{html.escape(row[1])}</b> {at[11:19]}<br>{html.escape(_detail(row))}")
        colors.append(style["color"])
        symbols.append(style["symbol"])
    if xs:
        fig.add_scatter(row=1, col=1, mode="markers", name="events", showlegend=False, x=xs,
                        y=[100] * len(xs), customdata=texts, cliponaxis=False,
                        hovertemplate="%{customdata}<extra></extra>",
                        marker={"color": colors, "symbol": symbols, "size": 9,
                                "line": {"width": 1, "color": "white"}})
    title = "GPU resources" + (" (SIMULATED GPUs, made-up numbers)" if source == "simulated" else "")
    fig.update_layout(
        paper_bgcolor="white", plot_bgcolor="white", font={"color": "#2a3f5f"}, height=640,
        margin={"l": 50, "r": 20, "t": 70, "b": 30}, title={"text": title, "x": 0.01},
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.06, "yanchor": "bottom"},
        hovermode="x unified",
    )
    fig.update_yaxes(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8")
    fig.update_xaxes(type="date", gridcolor="#EBF0F8")
    fig.update_yaxes(range=[0, 105], row=1, col=1)
    return fig


def _table(gpus: Sequence[tuple[str, int, str]], latest: dict) -> str:
    head, *body = readings_table(gpus, latest)

    def row(cells: Sequence[str], tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    return ("<table class='readings'>" + row(head, "th") + "".join(row(r, "td") for r in body)
            + "</table>")


def write_html(
    path: str | os.PathLike[str],
    history: History,
    events: Sequence[Sequence[Any]],
    latest: dict,
    source: str,
    *,
    status: str = "",
) -> str:
    """Write the pane's curves, events and readings to ``path`` (atomically); returns the path.

    Raises:
        FileNotFoundError: The directory of ``path`` does not exist.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the directory {folder} does not exist; "
                                "create it first or pick another path")
    figure = timeline_figure(history, events, source).to_html(
        include_plotlyjs=True, full_html=False, config={"displaylogo": False})
    listed = "".join(
        f"<tr><td>{html.escape(_local(r[0])[:19])}</td><td>{html.escape(r[1])}</td>"
        f"<td>{html.escape(_detail(r))}</td></tr>" for r in reversed(list(events)))
    text = summary(history, latest, source, events=len(events), status=status)
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>GPU pane</title><style>"
        "body{font-family:sans-serif;font-size:13px;color:#2a3f5f;margin:16px}"
        "table{border-collapse:collapse;margin:6px 0 14px}td,th{padding:2px 12px 2px 0;"
        "text-align:left}th{color:#666}</style></head><body>"
        f"<pre class='summary'>{html.escape(text)}</pre>{_table(history.gpus(), latest)}{figure}"
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
