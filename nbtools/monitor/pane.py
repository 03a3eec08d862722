"""``GPUPane``: the live GPU monitor shown in a notebook cell's output.

An ipywidgets box with a Refresh button, a Pause/Resume button, the status in
words, and a plotly chart (:class:`~nbtools.monitor._widget.GPUChart`) with
utilization, memory and temperature of every GPU, grouped by host, and the
run's events (:mod:`nbtools.events`) on the same time axis. The pane
is a view of a shared :class:`~nbtools.monitor.sampler.Sampler`: two panes on
the same GPUs poll once. Cell execution counts as activity through IPython's
``pre_run_cell``/``post_run_cell`` events. Its output also holds a still
picture and a line of text per host, kept current by the minute
(:mod:`nbtools.monitor._display`), which saved, exported and shared notebooks
show without a kernel.
"""

from __future__ import annotations

import html
import os
import threading
import time
from typing import Any

import ipywidgets as widgets

from nbtools import events as _events
from nbtools._internal.log import get_logger
from nbtools.monitor._display import PaneDisplay
from nbtools.monitor._widget import GPUChart
from nbtools.monitor.backends import Backend, NVMLBackend
from nbtools.monitor.readings import Sample, local_host
from nbtools.monitor.sampler import Sampler, acquire, release
from nbtools.monitor.snapshot import (
    PaneState,
    Snapshot,
    render_png,
    summary,
    world_now,
    world_summary,
)
from nbtools.monitor.timeline import (
    EVENT_COLUMNS,
    MAX_DRAWN,
    PROGRESS_KIND,
    WORLD_KINDS,
    EventFeed,
    drawn,
    encode,
    event_rows,
    step_rates,
    world_sizes,
)
from nbtools.monitor.timing import DEFAULT_HISTORY_SECONDS, DEFAULT_IDLE_TIMEOUT, DEFAULT_INTERVAL

__all__ = ["GPUPane"]

_log = get_logger("monitor")
#: What a pane on a machine without GPUs adds to its status line (HTML).
NO_GPU_HINT = (
    "to try the pane without a GPU: <code>%gpu_pane --simulated 4</code> or "
    "<code>GPUPane(simulated=4)</code>"
)
_ICONS = {"polling": "●", "paused": "⏸", "unavailable": "⚠", "closed": "■"}
#: Seconds between looks for new events while no GPU can be polled.
EVENTS_TICK_S = 1.0


def _ipython() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - ipywidgets depends on IPython
        return None
    return get_ipython()


class GPUPane:
    """Live utilization, memory and temperature of every GPU, with 2 hours of history.

    The run's events (``nbtools.events``: checkpoint saves, input stalls, failed
    ranks, restarts, your own ``events.emit``) are drawn on the same time axis
    and listed under the charts; :meth:`events` returns them. With no GPU to
    read, the pane still lists them as they arrive. Once the run's world size
    changes (``shrunk``, ``grew``), a low row at the bottom draws it over time,
    from the launch's size, with the cause and the step in its hover.

    Creating a pane inside IPython displays it. Polling runs on a background
    thread, pauses after ``idle_timeout`` seconds without a running cell or a
    click, and stops for good on :meth:`close`. Defaults: 10 s, 2 h and 5 min
    (:mod:`nbtools.monitor.timing`).

    Saved and shared notebooks: under the live view, the pane's output holds
    a still picture (PNG: the latest readings, the curves and the events) and
    one line of text per host, which GitHub, nbviewer, nbconvert and any
    viewer without JavaScript or widget state show (a live front end hides
    it). The picture is redrawn every ``SNAPSHOT_EVERY_S`` seconds (60) while
    new samples arrive, when the pane pauses or closes, and on
    :meth:`snapshot`, on a thread of its own (never on the polling thread),
    and replaces the saved one each time, so a notebook saved while the pane
    runs holds a picture at most a minute old; the live view is not redrawn
    for it. After :meth:`close` the output keeps the last picture and the
    text. :meth:`to_html` writes the curves and events to a standalone HTML
    file.

    Args:
        interval: Seconds between polls.
        history: Seconds of history kept (in bounded memory, at most
            ``MAX_HISTORY_POINTS`` samples per host) and drawn. The samples
            themselves come back from :meth:`history`.
        idle_timeout: Seconds without activity before polling pauses; None never pauses.
        backend: Source of readings; default :class:`~nbtools.monitor.NVMLBackend`.
            Use ``SimulatedBackend(num_gpus=4)`` for a demo without GPUs.
        cluster: ``"ray"``: every node of the connected Ray cluster, one small
            sampler actor per node (``pip install "nbtools[ray]"``). Not with ``backend``.
        simulated: Show this many simulated GPUs (made-up numbers) instead of the real
            ones, as ``%gpu_pane --simulated N`` does: a demo without GPUs. With
            ``cluster``, that many on every node. Not with ``backend``.
        display: Show the pane now (inside IPython). False: show it with ``display(pane)``.

    Example:
        >>> from nbtools.monitor import GPUPane
        >>> pane = GPUPane(simulated=4)  # doctest: +SKIP
        >>> pane.status  # doctest: +SKIP
        'polling'
        >>> pane.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        history: float = DEFAULT_HISTORY_SECONDS,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        backend: Backend | None = None,
        *,
        cluster: str | None = None,
        simulated: int | None = None,
        display: bool = True,
    ) -> None:
        if simulated is not None:
            if backend is not None:
                raise ValueError(
                    "pass either backend= or simulated=, not both; simulated=N is "
                    "backend=SimulatedBackend(num_gpus=N)"
                )
            if isinstance(simulated, bool) or not isinstance(simulated, int) or simulated < 1:
                raise ValueError(
                    f"simulated must be a positive number of GPUs, got {simulated!r}; "
                    "e.g. GPUPane(simulated=4)"
                )
            if cluster is None:
                from nbtools.monitor.simulated import SimulatedBackend

                backend = SimulatedBackend(num_gpus=simulated)
        if cluster is not None:
            if backend is not None:
                raise ValueError(
                    "pass either backend= or cluster=, not both; for simulated GPUs on every "
                    "node use backend=ClusterBackend(simulated=N) "
                    "(from nbtools.monitor import ClusterBackend)"
                )
            from nbtools.monitor.cluster import cluster_backend

            backend = cluster_backend(cluster, simulated=simulated)
        self.sampler: Sampler = acquire(
            backend if backend is not None else NVMLBackend(),
            interval=interval,
            history_seconds=history,
            idle_timeout=idle_timeout,
        )
        self._closed = False
        self._shown_in: int | None = None
        self._ip: Any = None
        if self.sampler.last_sample is None and self.sampler.status == "polling":
            self.sampler.refresh()  # a pane never opens empty
        shown = self.sampler.last_sample
        self._feed = EventFeed(_events.bus(), self.sampler.history_seconds, local_host=local_host())
        try:
            self._build()
        except BaseException:
            self._feed.close()
            release(self.sampler)
            raise
        self._events_stop = threading.Event()
        self._events_thread: threading.Thread | None = None
        self.sampler.add_sink(self._on_sample)
        self.sampler.add_watcher(self._on_status)
        self._follow_events(self.sampler.status)
        if self.sampler.last_sample is not shown:  # a poll slipped in while the chart was built
            self._chart.rebuild()
        self._ip = _ipython()
        if self._ip is not None:
            self._ip.events.register("pre_run_cell", self._cell_started)
            self._ip.events.register("post_run_cell", self._cell_finished)
            # The pane is built by a running cell; whatever follows in that cell is activity.
            self.sampler.set_busy(True)
        if display and self._ip is not None:
            self._ipython_display_()

    def _build(self) -> None:
        sampler = self.sampler
        latest = [sampler.last_sample] if sampler.last_sample is not None else []
        self._chart = GPUChart(
            sampler.samples, sampler.backend.source, latest=latest, feed=self._feed
        )
        self._refresh_button = widgets.Button(
            description="Refresh",
            icon="refresh",
            tooltip="Sample every GPU now",
            layout=widgets.Layout(width="auto", flex="0 0 auto"),
        )
        self._toggle_button = widgets.Button(layout=widgets.Layout(width="auto", flex="0 0 auto"))
        self._status_label = widgets.HTML()
        self._refresh_button.on_click(lambda _b: self.refresh())
        self._toggle_button.on_click(lambda _b: self._toggle())
        bar = widgets.HBox(
            [self._refresh_button, self._toggle_button, self._status_label],
            layout=widgets.Layout(align_items="center"),
        )
        self.widget = widgets.VBox([bar, self._chart])
        # Closing the widget itself (``pane.widget.close()``) closes the pane and its polling.
        self.widget.observe(self._widget_closed, names="comm")
        self._display = PaneDisplay(self.widget, self._chart, self._draw)
        self._show_status(sampler.status, sampler.message)

    # --- public API -----------------------------------------------------------------

    @property
    def status(self) -> str:
        """``"polling"``, ``"paused"``, ``"unavailable"`` or ``"closed"``."""
        return "closed" if self._closed else self.sampler.status

    @property
    def message(self) -> str:
        """Why the pane is paused or unavailable, in plain words."""
        return self.sampler.message

    def refresh(self) -> Sample | None:
        """Sample every GPU now and show it; resumes an idle pause."""
        return self.sampler.refresh()

    def pause(self) -> None:
        """Stop polling until :meth:`resume`."""
        self.sampler.pause()

    def resume(self) -> None:
        """Poll again (after :meth:`pause`, an idle pause, or to retry unavailable GPUs)."""
        self.sampler.resume()

    def history(self) -> Any:
        """The history in long form: a pandas DataFrame when pandas is installed, else columns.

        Returns:
            One row per GPU and sample with ``time`` (seconds since the epoch),
            ``host``, ``gpu``, ``name`` and every field of
            :class:`~nbtools.monitor.GPUReading` (missing = not available).
        """
        columns = self.sampler.samples.columns()
        try:
            import pandas as pd
        except ImportError:
            return columns
        frame = pd.DataFrame(columns)
        frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
        return frame

    def events(self) -> Any:
        """The run's events of the last ``history`` seconds, oldest first.

        Returns:
            A pandas DataFrame when pandas is installed, else a list of dicts.
            Flags are among them: ``hang`` and ``straggler`` events (``rank``,
            ``node``, ``since``, ``score``; ``ended`` when over). The ranks' progress
            reports are not (the report draws them as step rates).
            Columns: ``time`` (UTC), ``host``, ``rank``, ``kind``, ``message``,
            ``step``, ``pid`` (``rank``, ``step`` and ``pid`` as pandas ``Int64``:
            whole numbers, ``<NA>`` where an event has none), then one column
            per field that any event carries.

        Example:
            >>> pane.events().query("kind == 'checkpoint_saved'")[["time", "step", "blocked_s"]]  # doctest: +SKIP
        """
        kept = drawn(self._feed.bus.log(since=time.time() - self.sampler.history_seconds))
        rows = event_rows(kept)
        try:
            import pandas as pd
        except ImportError:
            return rows
        fields = list(dict.fromkeys(k for row in rows for k in row if k not in EVENT_COLUMNS))
        frame = pd.DataFrame(rows, columns=[*EVENT_COLUMNS, *fields])
        frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
        for name in ("rank", "step", "pid"):  # whole numbers, missing = <NA>
            frame[name] = frame[name].astype("Int64")
        return frame

    @property
    def dropped_events(self) -> int:
        """Events the ranks dropped because the kernel did not keep up (shown when > 0)."""
        return self._feed.dropped()

    def snapshot(self) -> Snapshot:
        """Draw the still picture now and put it in the pane's output (saved with the notebook).

        The pane also does this by itself every ``SNAPSHOT_EVERY_S`` seconds
        while it polls; call it to save the very latest.

        Returns:
            The :class:`~nbtools.monitor.snapshot.Snapshot` (``.png`` bytes,
            ``.text``); shown in a cell, it is the picture.
        """
        if self._closed:
            return self._display.last or self._draw()
        return self._display.refresh()

    def to_html(self, path: str | os.PathLike[str]) -> str:
        """Write the curves, the events and the latest readings to one standalone HTML file.

        The file carries plotly.js (no network needed to open it), e.g. for a
        run's MLflow artifacts: ``mlflow.log_artifact(pane.to_html("gpus.html"))``.

        Returns:
            The path written.
        """
        from nbtools.monitor.report import write_html

        return write_html(path, self._state())

    def close(self) -> None:
        """Stop showing and, when no other pane uses it, stop the sampler thread (idempotent).

        The pane's output keeps its last picture (drawn now) and its text.
        """
        if self._closed:
            return
        self._closed = True
        self._display.close()
        self._stop_events()
        self._feed.close()
        self.sampler.remove_sink(self._on_sample)
        self.sampler.remove_watcher(self._on_status)
        if self._ip is not None:
            for event, callback in (
                ("pre_run_cell", self._cell_started),
                ("post_run_cell", self._cell_finished),
            ):
                try:
                    self._ip.events.unregister(event, callback)
                except ValueError:
                    pass
            self.sampler.set_busy(False)
        release(self.sampler)
        for child in (
            self._refresh_button,
            self._toggle_button,
            self._status_label,
            self.widget.children[0],
            self._chart,
            self.widget,
        ):
            for part in (getattr(child, "layout", None), getattr(child, "style", None), child):
                if part is not None:
                    part.close()

    def __enter__(self) -> GPUPane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ipython_display_(self) -> None:
        if self._closed:
            _log.warning("this GPU pane is closed; create a new GPUPane to watch the GPUs")
            return
        count = getattr(self._ip, "execution_count", None)
        if count is not None and count == self._shown_in:
            return  # already shown by the constructor of this very cell
        self._shown_in = count
        self._display.show()

    def __repr__(self) -> str:
        return f"<GPUPane {self.status} {self.sampler.backend.key}>"

    # --- reactions ---------------------------------------------------------------------

    def _toggle(self) -> None:
        if self.sampler.status in ("paused", "unavailable"):
            self.resume()
        else:
            self.pause()

    def _widget_closed(self, change: dict[Any, Any]) -> None:
        if change.get("new") is None:
            self.close()

    def _cell_started(self, *_args: Any) -> None:
        self.sampler.set_busy(True)

    def _cell_finished(self, *_args: Any) -> None:
        self.sampler.set_busy(False)

    def _on_sample(self, sample: Sample) -> None:
        if not self._closed:
            self._chart.push(sample)
            self._display.sampled()

    def _on_status(self, status: str, message: str) -> None:
        if not self._closed:
            self._show_status(status, message)
            self._follow_events(status)
            if status != "polling":
                self._display.soon()  # a paused pane's picture shows where it stopped

    # --- the still picture -----------------------------------------------------------

    def _event_rows(self) -> list[list[Any]]:
        kept = drawn(self._feed.bus.log(since=time.time() - self.sampler.history_seconds))
        return [encode(e, self._feed.local_host) for e in kept[-MAX_DRAWN:]]

    def _step_rates(self) -> dict[int, tuple[list[float], list[float]]]:
        since = time.time() - self.sampler.history_seconds
        return step_rates(self._feed.bus.log(since=since, kinds=[PROGRESS_KIND]))

    def _status_text(self) -> str:
        status = self.status
        if status == "polling":
            return f"polling every {self.sampler.interval:g} s"
        if status == "closed":
            return "closed"
        return self.sampler.message or status

    def _state(self) -> PaneState:
        return PaneState(
            self.sampler.samples,
            self._event_rows(),
            self._chart.glance(),
            self.sampler.backend.source,
            status=self._status_text(),
            rates=self._step_rates(),
            world=world_sizes(
                self._feed.bus.log(
                    since=time.time() - self.sampler.history_seconds, kinds=WORLD_KINDS
                )
            ),
        )

    def _draw(self) -> Snapshot:
        state = self._state()
        png = render_png(state)
        text = summary(
            state.history,
            state.latest,
            state.source,
            events=len(state.events),
            status="" if self.status == "polling" else state.status,
            world=world_summary(world_now(state.world)),
        )
        return Snapshot(png=png, text=text, time=time.time())

    def _follow_events(self, status: str) -> None:
        """Without GPUs to poll, send the run's events on their own (they usually ride on polls)."""
        if status != "unavailable":
            self._stop_events()
        elif self._events_thread is None:
            self._events_stop.clear()
            self._events_thread = threading.Thread(
                target=self._pump_events, name="nbtools-pane-events", daemon=True
            )
            self._events_thread.start()

    def _pump_events(self) -> None:
        while not self._events_stop.wait(EVENTS_TICK_S):
            try:
                if self._chart.push_events():
                    self._display.sampled()  # the picture lists them too
            except Exception:  # noqa: BLE001 - a closed comm must not end in a traceback
                _log.debug("could not send the pane's events", exc_info=True)

    def _stop_events(self) -> None:
        thread, self._events_thread = self._events_thread, None
        if thread is not None:
            self._events_stop.set()
            if thread is not threading.current_thread():
                thread.join()

    def _show_status(self, status: str, message: str) -> None:
        sampler = self.sampler
        if status == "polling":
            text = f"polling every {sampler.interval:g} s"
        else:
            text = message or status
        text = html.escape(text)
        if status == "unavailable" and isinstance(sampler.backend, NVMLBackend):
            text += " · " + NO_GPU_HINT
        if sampler.simulated:
            text += " · <b>simulated GPUs</b>"
        self._status_label.value = (
            f'<span class="nbtools-gpu-status" data-status="{status}">'
            f"{_ICONS.get(status, '')} {text}</span>"
        )
        self._toggle_button.description = "Pause" if status == "polling" else "Resume"
        self._toggle_button.icon = "pause" if status == "polling" else "play"
        self._toggle_button.disabled = status == "closed"
        self._refresh_button.disabled = status == "closed"
