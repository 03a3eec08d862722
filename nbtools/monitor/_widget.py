"""The chart of the GPU pane: an anywidget whose front end draws with plotly.js.

The kernel sends the whole figure (layout from plotly's ``make_subplots``, the
history as binary arrays: one float64 time array per host, one uint16 array
per trace) only when the set of GPUs changes or a view asks for it; every poll
after that is a custom message of a few hundred bytes, events included, that
the front end appends with ``Plotly.extendTraces``.

plotly.js (about 4.8 MB, 1.5 MB gzip) comes from the plotly Python package,
so no JupyterLab extension beyond anywidget's is needed, and it is never part
of the widget state (a saved notebook stays small). It travels as the binary
buffer of a custom message, gzip-compressed: pushed to a chart shown while no
view of it has said its page holds a copy (:meth:`GPUChart.push_library`,
called by the pane's display worker a moment after the pane is shown, since
a front end's request waits while a cell runs), and sent to any view that
asks. The page keeps one copy for every chart on it; on an idle kernel the
view's "I have it" arrives first and nothing is pushed.
"""

from __future__ import annotations

import gzip
import json
import math
import threading
import time
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets

from nbtools.monitor._rates import RateRow
from nbtools.monitor.history import History
from nbtools.monitor.readings import Sample, describe_throttle
from nbtools.monitor.snapshot import COLORS as _COLORS
from nbtools.monitor.snapshot import WORLD_TITLE, gpu_label, world_now, world_row
from nbtools.monitor.timeline import (
    MESSAGE_BUDGET,
    PROGRESS_KIND,
    WORLD_KINDS,
    EventFeed,
    WorldStep,
    gpu_ranks,
    world_sizes,
)

__all__ = ["GPUChart", "plotly_js_gzip"]

_GIB = 1024**3
_HERE = Path(__file__).parent
# (history field, scale, digits) of the three panels, in trace order.
_PANELS = (("utilization", 1.0, 1), ("memory_used", 1.0 / _GIB, 2), ("temperature", 1.0, 1))
_TITLES = ("Utilization (%)", "Memory used (GiB)", "Temperature (°C)")
_DASHES = ("solid", "dot", "dash", "longdash", "dashdot")
_MISSING = 65535  # uint16 value of a point that was not available
_RATE_TITLE = "Steps per second, by rank"
_RATE_POINTS = 1200  # per rank in the live chart (reports come about once a second)
_GRID = "#EBF0F8"


@cache
def _plotly_js() -> bytes:
    return resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()


#: Pushes of plotly.js that no view asked for, per kernel: the first chart shown gets two (the
#: first may come before its page can take it); later charts on that page share its copy, and
#: a page opened later (a reload) asks, and gets its answer once the kernel is free.
PUSHES = 2
_pushes = {"left": PUSHES}
_pushes_lock = threading.Lock()


@cache
def plotly_js_gzip() -> bytes:
    """plotly.min.js as the front end receives it: gzip-compressed (computed once)."""
    return gzip.compress(_plotly_js(), compresslevel=6, mtime=0)


def _scaled(values: np.ndarray, factor: float) -> bytes:
    """Values times ``factor`` as little-endian uint16, ``_MISSING`` where not available."""
    scaled = np.clip(np.rint(values * factor), 0, _MISSING - 1)
    return np.where(np.isnan(values), _MISSING, scaled).astype("<u2").tobytes()


def _round(value: float | None, scale: float, digits: int) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return round(value * scale, digits)


def _note(reading: Any) -> str:
    notes = [r for r in describe_throttle(reading.throttle_reasons) if r != "idle"]
    if getattr(reading, "problem", ""):
        notes.insert(0, reading.problem)  # lost, or why MIG shows no utilization
    if reading.ecc_uncorrected:
        notes.append(f"{reading.ecc_uncorrected} uncorrected ECC errors")
    return "; ".join(notes)


def _glance(reading: Any) -> list:
    """What a poll sends per GPU: the three plotted values, power and a warning note."""
    values: list = [_round(getattr(reading, f), s, d) for f, s, d in _PANELS]
    return [*values, _round(reading.power, 1.0, 0), _note(reading)]


class GPUChart(anywidget.AnyWidget):
    """Three panels (utilization, memory, temperature), one line per GPU, grouped by host.

    The run's events are drawn on the same time axis (see :mod:`nbtools.monitor.timeline`)
    and listed under the panels. When ranks report progress, a row below the
    panels draws each rank's steps per second on the same axis (a flagged rank
    drawn bold, a hang's band from where it began); without GPUs it is the only row.
    Once the run's world size changed, a low row at the bottom draws it
    (:func:`~nbtools.monitor.timeline.world_sizes`), carried on to each poll's time.

    Args:
        history: The history to draw; the chart reads it, the sampler fills it.
        source: ``"NVML"`` or ``"simulated"`` (shown in the chart).
        latest: Samples already in the history whose current values should show at once.
        feed: Events to draw; None draws none.
    """

    _esm = (_HERE / "_chart.js").read_text("utf-8")
    _css = (_HERE / "_chart.css").read_text("utf-8")
    _figure = traitlets.Dict().tag(sync=True)
    #: The pane's last still picture (PNG): what a view shows when no kernel sends plotly.js.
    _snapshot = traitlets.Bytes(b"").tag(sync=True)

    def __init__(
        self,
        history: History,
        source: str,
        latest: list[Sample] | tuple[()] = (),
        feed: EventFeed | None = None,
        **kwargs: Any,
    ) -> None:
        self._history = history
        self._source = source
        self._feed = feed
        self._lock = threading.Lock()
        self._seq = 1
        self._rows: dict[str, tuple[int, list[int]]] = {}  # host -> (first row, gpu indices)
        self._latest: dict[tuple[str, int], Any] = {}  # (host, index) -> last reading
        self._last_time: float | None = None
        self._told = (0, 0)  # (dropped, not drawn) as the front end last heard them
        self._rates = RateRow(_RATE_POINTS)
        self._rank_order: list[int] = []  # the ranks of the figure's step-rate traces
        self._paired: dict[tuple[str, int], list[int]] = {}  # GPU row -> its ranks, by UUID
        self._world: list[WorldStep] = []  # the world size's steps the figure draws
        self._world_seen = -1  # the feed's count of world events when they were read
        if feed is not None:
            feed.take_progress()  # the bus has them too: start from its record
            since = time.time() - feed.horizon_s
            self._rates.add(feed.bus.log(since=since, kinds=[PROGRESS_KIND]))
        for sample in latest:
            self._remember(sample)
        # The figure travels with the comm's opening message, not in a second one.
        self.library_held = False  # a view of this chart said its page holds plotly.js
        super().__init__(_figure=self._build(), **kwargs)
        self.on_msg(self._on_front_end)

    # --- full figure ------------------------------------------------------------

    def rebuild(self) -> None:
        """Send the whole figure again (all GPUs, the whole history, the events kept)."""
        with self._lock:
            self._seq += 1
            self._figure = self._build()

    def _build(self) -> dict:
        from plotly.subplots import make_subplots

        gpus = self._history.gpus()
        hosts = self._history.hosts()
        self._rows, row = {}, 0
        for host in hosts:
            indices = [i for h, i, _ in gpus if h == host]
            self._rows[host] = (row, indices)
            row += len(indices)
        ranks = self._rank_order = self._rates.ranks()
        world = self._world = self._world_steps()
        # The GPU panels when there are GPUs, then the step-rate row when ranks report, then
        # a low row of the world size once it changed.
        panels = bool(gpus) or not (ranks or world)
        titles = [*(_TITLES if panels else ()), *([_RATE_TITLE] if ranks else [])]
        titles += [WORLD_TITLE] if world else []
        fig = make_subplots(
            rows=len(titles),
            cols=1,
            shared_xaxes=True,
            vertical_spacing=0.07,
            subplot_titles=titles,
            row_heights=[*[1.0] * (len(titles) - 1), 0.45] if world else None,
        )
        max_mem = max((self._total(h, i) or 0 for h, i, _ in gpus), default=0) / _GIB
        # Scaled to uint16 on the wire: 0.1 %, 0.01 GiB (0.1 GiB past 650 GiB), 0.1 degC.
        factors = (10.0, 100.0 if max_mem < 650 else 10.0, 10.0)
        times: dict[str, list] = {}
        ys: list[bytes] = []
        self._paired = self._pairs()
        for panel, (field, scale, _digits) in enumerate(_PANELS):
            for host, index, name in gpus:
                stamps, values = self._history.series(host, index, field)
                times.setdefault(host, stamps)
                label = gpu_label(index)
                label = f"{host} · {label}" if len(hosts) > 1 else label
                paired = self._paired.get((host, index), [])
                if paired:  # its rank's colour, and the rank named
                    label += " · rank" + ("s " if len(paired) > 1 else " ")
                    label += ", ".join(map(str, paired))
                colour = paired[0] if len(paired) == 1 else index
                fig.add_scatter(
                    row=panel + 1,
                    col=1,
                    mode="lines",
                    name=label,
                    legendgroup=label,
                    showlegend=panel == 0,
                    hovertemplate=f"{name}<br>%{{y}}<extra>{label}</extra>",
                    line={
                        "color": _COLORS[colour % len(_COLORS)],
                        "dash": _DASHES[hosts.index(host) % len(_DASHES)],
                        "width": 1.5,
                    },
                )
                ys.append(_scaled(values * scale, factors[panel]))
        rate_x, rate_y = [], []
        for rank in ranks:
            when, values = self._rates.series[rank]
            label = f"rank {rank}"
            fig.add_scatter(
                row=len(titles),
                col=1,
                mode="lines",
                name=label,
                legendgroup=label,
                hovertemplate=f"%{{y}} steps/s<extra>{label}</extra>",
                line={"color": _COLORS[rank % len(_COLORS)], "width": 1.5},
            )
            rate_x.append((np.asarray(when, dtype="<f8") * 1000.0).tobytes())
            rate_y.append(list(values))
        if ranks:
            fig.update_yaxes(rangemode="tozero", row=len(titles) - bool(world), col=1)
        world_x, world_y, world_text = [], [], []
        if world:
            for point in world_now(world):
                world_x.append(round(point.time * 1000))
                world_y.append(point.size)
                world_text.append(point.text)
            world_row(fig, len(titles), world)  # its points travel as "wx", "wy", "wt"
        title = "GPU resources" + (" (simulated)" if self._source == "simulated" else "")
        title = title if panels else "Training run (no GPU readings)"
        main = len(titles) - bool(world)
        fig.update_layout(
            paper_bgcolor="white",
            plot_bgcolor="white",
            font={"color": "#2a3f5f"},
            height=(160 * main + 80 if panels else 140 + 160 * (main - 1)) + 80 * bool(world),
            margin={"l": 50, "r": 20, "t": 60, "b": 30},
            title={"text": title, "x": 0.01, "y": 0.985, "font": {"size": 14}},
            legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.07, "yanchor": "bottom"},
            hovermode="x unified",
            autosize=True,
            uirevision="nbtools-gpu",
        )
        fig.update_yaxes(gridcolor=_GRID, zerolinecolor=_GRID)
        fig.update_xaxes(type="date", gridcolor=_GRID)
        fig.update_xaxes(tickformat="%H:%M:%S", showticklabels=True, row=len(titles), col=1)
        overlay = f"y{len(titles) + 1}"
        if panels:
            fig.update_yaxes(range=[0, 100], row=1, col=1)
            fig.update_yaxes(range=[0, max(max_mem, 1.0) * 1.05], row=2, col=1)
        else:  # the events' marks on their own axis over the first row's top edge
            fig.update_layout(
                {
                    f"yaxis{len(titles) + 1}": {
                        "overlaying": "y",
                        "range": [0, 1],
                        "visible": False,
                        "fixedrange": True,
                    }
                }
            )
        spec = fig.to_plotly_json()
        feed = self._feed
        if feed is not None:
            self._told = (feed.dropped(), feed.not_drawn)
        return {
            "n": self._seq,
            "m": self._history.capacity,
            "source": self._source,
            "hosts": len(hosts),
            "data": spec["data"],
            "layout": spec["layout"],
            # Epoch milliseconds per host (float64), values per trace (uint16 / factor).
            "x": [(stamps * 1000.0).astype("<f8").tobytes() for stamps in times.values()],
            "xi": [list(times).index(h) for h, _, _ in gpus],
            "y": ys,
            "f": factors,
            # Per row: host, index, name, memory GiB, power limit, and the row's label
            # (its index, a MIG device's "1 · MIG 2", the ranks that use it).
            "gpus": [
                [
                    h,
                    i,
                    name,
                    _round(self._total(h, i), 1.0 / _GIB, 0),
                    self._limit(h, i),
                    self._row_label(h, i),
                ]
                for h, i, name in gpus
            ],
            "glance": [
                _glance(self._latest[(h, i)]) if (h, i) in self._latest else None
                for h, i, _ in gpus
            ],
            "last": None if self._last_time is None else round(self._last_time * 1000),
            "ev": [] if feed is None else feed.snapshot(),
            "h": round(1000 * (feed.horizon_s if feed is not None else 0)),
            "d": self._told[0],
            "nd": self._told[1],
            # The step-rate row: its ranks, in trace order after the GPUs' traces, their
            # times (epoch ms, float64) and steps per second; "ey" where event marks sit.
            "ranks": ranks,
            "rx": rate_x,
            "ry": rate_y,
            "rp": _RATE_POINTS,
            "ey": ["y", 100] if panels else [overlay, 1],
            # The world size's row (once it changed): its trace's index (-1: none), its
            # steps (epoch ms, processes, hover text), and whether the run goes on (each
            # poll then carries the line on to the poll's time).
            "wi": len(spec["data"]) - 1 if world else -1,
            "wx": world_x,
            "wy": world_y,
            "wt": world_text,
            "wl": bool(world) and world[-1].size is not None,
        }

    def _world_steps(self) -> list[WorldStep]:
        """The world size's steps over the history, as the bus has them now."""
        feed = self._feed
        if feed is None:
            return []
        self._world_seen = feed.world_events
        since = time.time() - feed.horizon_s
        return world_sizes(feed.bus.log(since=since, kinds=WORLD_KINDS))

    def _world_moved(self) -> bool:
        """Whether events that arrived since the figure was built changed the world size's
        line (it then comes with the whole figure); one integer compare when none did."""
        feed = self._feed
        if feed is None or feed.world_events == self._world_seen:
            return False
        return self._world_steps() != self._world

    def _total(self, host: str, index: int) -> float | None:
        reading = self._latest.get((host, index))
        return None if reading is None else reading.memory_total

    def _row_label(self, host: str, index: int) -> str:
        label = gpu_label(index).removeprefix("GPU ")
        paired = self._paired.get((host, index), [])
        return label + (f" · rank {', '.join(map(str, paired))}" if paired else "")

    def _pairs(self) -> dict[tuple[str, int], list[int]]:
        """The ranks of each GPU row, as far as the ranks said which GPU they use."""
        if self._feed is None or not self._feed.rank_gpus:
            return {}
        return gpu_ranks(self._latest, dict(self._feed.rank_gpus))

    def _limit(self, host: str, index: int) -> float | None:
        reading = self._latest.get((host, index))
        return None if reading is None else _round(reading.power_limit, 1.0, 0)

    # --- per poll ----------------------------------------------------------------

    def push(self, sample: Sample) -> None:
        """Show a sample that the history already holds: a small message, or a rebuild.

        Events queued since the last poll ride in the same message, which stays
        within ``MESSAGE_BUDGET`` bytes; what does not fit waits for the next poll.
        """
        with self._lock:
            self._remember(sample)
            row = self._rows.get(sample.host)
            rates = self._new_rates()
            if (
                row is None
                or row[1] != [r.index for r in sample.gpus]
                or rates is None
                or self._pairs() != self._paired
                or self._world_moved()
            ):
                self._seq += 1
                self._figure = self._build()
                return
            self._seq += 1
            message: dict[str, Any] = {
                "k": "s",
                "n": self._seq,
                "t": round(sample.time * 1000),
                "r": row[0],
                "g": [_glance(r) for r in sample.gpus],
            }
            if rates:
                message["sr"] = rates
            self._add_events(message)
            self.send(message)

    def push_events(self) -> bool:
        """Send the events queued since the last message on their own; True when any were sent.

        For a pane with no GPU to poll: without samples, events would wait for a rebuild.
        """
        with self._lock:
            rates = self._new_rates()
            if rates is None or self._world_moved():  # a new rank, or the world size moved
                self._seq += 1
                self._figure = self._build()
                return True
            message: dict[str, Any] = {"k": "e", "n": self._seq + 1}
            if rates:
                message["sr"] = rates
            self._add_events(message)
            if "e" not in message and "d" not in message and "sr" not in message:
                return False
            self._seq += 1
            self.send(message)
            return True

    def _new_rates(self) -> list[list] | None:
        """Step-rate points since the last message; None when a rank is new (rebuild)."""
        if self._feed is None:
            return []
        points = self._rates.add(self._feed.take_progress())
        if self._rates.ranks() != self._rank_order:
            return None
        return points

    def _add_events(self, message: dict[str, Any]) -> None:
        feed = self._feed
        if feed is None:
            return
        told = (feed.dropped(), feed.not_drawn)
        if told != self._told:  # said once, whenever a count changes
            message["d"], message["nd"] = self._told = told
        if feed.pending:
            # The comm wraps the content in {"method": "custom", "content": ...}.
            used = 40 + len(json.dumps(message, ensure_ascii=False)) + len(', "e": []')
            rows = feed.take(MESSAGE_BUDGET - used)
            if rows:
                message["e"] = rows

    def _remember(self, sample: Sample) -> None:
        for reading in sample.gpus:
            self._latest[(sample.host, reading.index)] = reading
        self._last_time = sample.time

    def set_snapshot(self, png: bytes) -> None:
        """Keep the pane's latest still picture in the state (shown when no kernel answers)."""
        self._snapshot = png

    def glance(self) -> dict[tuple[str, int], Any]:
        """The latest reading of every GPU, ``(host, index) -> GPUReading``."""
        with self._lock:
            return dict(self._latest)

    # --- plotly.js -------------------------------------------------------------------

    @property
    def needs_library(self) -> bool:
        """True until a view of this chart said its page holds plotly.js."""
        return not self.library_held

    def push_library(self, *, unasked: bool = True) -> bool:
        """Send plotly.js (gzip) in a custom message: not part of the state, not saved.

        Args:
            unasked: A push no view asked for; sent only while the kernel's
                budget (``PUSHES``) lasts. True when sent.
        """
        if self.comm is None:
            return False
        if unasked:
            with _pushes_lock:
                if _pushes["left"] <= 0:
                    return False
                _pushes["left"] -= 1
        self.send({"k": "lib"}, buffers=[plotly_js_gzip()])
        return True

    def _on_front_end(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict):
            return
        if content.get("k") == "lib":  # a page without plotly.js asks for it
            self.push_library(unasked=False)
        elif content.get("k") == "have":
            self.library_held = True
        elif content.get("k") == "sync":
            with self._lock:
                current = content.get("n") == self._seq
            if not current:
                self.rebuild()
