"""Where a GPU pane lives in the notebook: two outputs, the live view and its picture.

The pane shows as two ``display_data`` outputs, each with a display id of its own:

- the live view: the pane's widget (``application/vnd.jupyter.widget-view+json``,
  and an empty ``text/plain``);
- the picture: a still picture (``image/png``, :mod:`nbtools.monitor.snapshot`),
  one line of text per host (``text/plain``), the same picture with its alt text
  and those lines under it as HTML (``text/html``: nbconvert and GitHub show the
  text as text, not only as pixels), and the view of a small hidden
  widget, so that a front end with the widget manager (JupyterLab, Notebook 7,
  VS Code) draws nothing there while the live view is on the page.

GitHub, nbviewer, nbconvert without widget state and any viewer without
JavaScript show the picture (the live view's model is not in their state, so
they skip it); a terminal shows the text.

Why two outputs: a front end re-renders an output it is told to update
(``update_display_data``), and JupyterLab re-renders a widget view by making a
new view of the model and leaving the old one behind: updating a bundle that
held both the live view and the picture would rebuild the live pane, its
figure and the user's zoom every time the picture changed. Updating the
picture output re-renders only the hidden widget, so the picture can follow
the run: it is redrawn by :meth:`PaneDisplay.refresh` (an explicit
``pane.snapshot()``, close) and by a worker thread when the pane pauses and
every ``SNAPSHOT_EVERY_S`` seconds (60) while new samples come in, never on
the sampler's thread, so a poll never waits for a drawing. Each drawing
updates the picture output in place and the chart's ``_snapshot`` trait (what
a view of saved widget state shows without a kernel). The live output is
updated once: when the pane closes it keeps only its empty text, and the picture output
keeps the last picture and the text, without the hidden widget.

The same worker pushes plotly.js to the chart a moment after it is shown (see
:meth:`~nbtools.monitor._widget.GPUChart.push_library`).
"""

from __future__ import annotations

import base64
import html
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.monitor.snapshot import Snapshot

__all__ = [
    "ANCHOR_CLASS",
    "PaneDisplay",
    "SNAPSHOT_EVERY_S",
    "TEXT_CLASS",
    "THREAD_NAME",
    "WIDGET_VIEW",
    "alt_text",
]

_log = get_logger("monitor")
#: Seconds between refreshes of the still picture while samples come in.
SNAPSHOT_EVERY_S = 60.0
#: Seconds after the pane is shown at which plotly.js is pushed to a view that has not said it has it.
PUSH_AFTER_S = (0.3, 3.0)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
THREAD_NAME = "nbtools-pane-display"
#: CSS class of the hidden widget in the picture output (its output is hidden in JupyterLab).
ANCHOR_CLASS = "nbtools-gpu-still-anchor"
#: CSS class of the text under the picture in the output's HTML.
TEXT_CLASS = "nbtools-gpu-still-text"


def alt_text(snapshot: Snapshot) -> str:
    """What the still picture shows, in words: its panels and the pane's line(s) of text."""
    return (
        "GPU pane, still picture: utilization, memory and temperature of each GPU over "
        "time, with the run's events. " + "; ".join(snapshot.text.splitlines())
    )


class PaneDisplay:
    """The outputs of one pane: shows them, refreshes the picture, ends with the picture.

    Args:
        widget: The pane's top widget (its model id goes in the live output).
        chart: The pane's chart (receives the picture, and plotly.js pushes).
        take: Draws a new :class:`~nbtools.monitor.snapshot.Snapshot` of the pane.
        every: Seconds between refreshes while new samples arrive (``SNAPSHOT_EVERY_S``).
    """

    def __init__(
        self, widget: Any, chart: Any, take: Callable[[], Snapshot], every: float | None = None
    ) -> None:
        name = uuid.uuid4().hex
        self.display_id = f"nbtools-gpu-pane-{name}"
        self.picture_id = f"nbtools-gpu-picture-{name}"
        self._widget = widget
        self._chart = chart
        self._take = take
        self._every = SNAPSHOT_EVERY_S if every is None else every
        self._shown = False
        self._live = True
        self._anchor: Any = None  # the hidden widget of the picture output
        self.last: Snapshot | None = None
        self._dirty = False
        self._lock = threading.Lock()  # one drawing at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _view(model_id: str) -> dict[str, Any]:
        return {"version_major": 2, "version_minor": 0, "model_id": model_id}

    def view_bundle(self) -> dict[str, Any]:
        """The live output's representations: the pane's widget view (none once closed).

        Its text is empty: the picture output under it says it all, and
        exporters without widget state have something to write.
        """
        data: dict[str, Any] = {"text/plain": ""}
        if self._live:
            data[WIDGET_VIEW] = self._view(self._widget.model_id)
        return data

    def bundle(self, snapshot: Snapshot) -> dict[str, Any]:
        """The picture output's representations: PNG, text, HTML and (while live) the hidden widget.

        The HTML is the picture with its alt text (:func:`alt_text`) and the text's lines
        under it: what an export without widget state shows, words included.
        """
        png = base64.b64encode(snapshot.png).decode("ascii")
        lines = "<br>".join(html.escape(line) for line in snapshot.text.splitlines())
        data: dict[str, Any] = {
            "text/plain": snapshot.text,
            "text/html": (
                f'<img src="data:image/png;base64,{png}" '
                f'alt="{html.escape(alt_text(snapshot), quote=True)}">\n'
                f'<p class="{TEXT_CLASS}">{lines}</p>'
            ),
            "image/png": png,
        }
        if self._live and self._anchor is not None:
            data[WIDGET_VIEW] = self._view(self._anchor.model_id)
        return data

    @staticmethod
    def metadata(snapshot: Snapshot) -> dict[str, Any]:
        """The picture output's metadata: the PNG's alt text, for front ends that read it."""
        return {"image/png": {"alt": alt_text(snapshot)}}

    def show(self) -> None:
        """Display the pane (IPython), or show it again: every output of it is updated together."""
        from IPython.display import display

        if self._live and self._anchor is None:
            import ipywidgets as widgets

            self._anchor = widgets.Box(layout=widgets.Layout(display="none"))
            self._anchor.add_class(ANCHOR_CLASS)
        snapshot = self.refresh(publish=False)
        display(self.view_bundle(), raw=True, display_id=self.display_id)
        display(
            self.bundle(snapshot),
            raw=True,
            metadata=self.metadata(snapshot),
            display_id=self.picture_id,
        )
        self._shown = True
        if self._live and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def refresh(self, *, publish: bool = True) -> Snapshot:
        """Draw a new picture now (caller's thread) and put it in every picture output of the pane."""
        with self._lock:
            self._dirty = False
            snapshot = self._take()
            if self._live:
                self._chart.set_snapshot(snapshot.png)
            if publish and self._shown:
                from IPython.display import update_display

                update_display(
                    self.bundle(snapshot),
                    raw=True,
                    metadata=self.metadata(snapshot),
                    display_id=self.picture_id,
                )
            self.last = snapshot  # once it is in the outputs
        return snapshot

    def sampled(self) -> None:
        """A new sample or event is in (cheap: the sampler's thread calls it)."""
        self._dirty = True

    def soon(self) -> None:
        """Refresh on the worker as soon as it can (the pane paused or stopped)."""
        self._dirty = True
        self._wake.set()

    def close(self) -> None:
        """Stop the worker; the live output empties, the picture output keeps picture and text."""
        thread, self._thread = self._thread, None
        self._stop.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._live = False
        if self._shown:
            try:
                from IPython.display import update_display

                update_display(self.view_bundle(), raw=True, display_id=self.display_id)
                self.refresh()
            except Exception:  # noqa: BLE001 - closing must not fail over a picture
                _log.warning("could not draw the GPU pane's last picture", exc_info=True)
        anchor, self._anchor = self._anchor, None
        if anchor is not None:
            anchor.layout.close()
            anchor.close()

    def _run(self) -> None:
        start = time.monotonic()
        for delay in PUSH_AFTER_S:
            if self._stop.wait(max(0.0, start + delay - time.monotonic())):
                return
            if self._chart.needs_library:
                try:
                    self._chart.push_library()
                except Exception:  # noqa: BLE001 - a closed comm must not end in a traceback
                    _log.debug("could not send plotly.js", exc_info=True)
        due = time.monotonic() + self._every
        while True:
            woke = self._wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            if not woke:
                due = time.monotonic() + self._every
            if self._dirty:
                try:
                    self.refresh()
                except Exception:  # noqa: BLE001 - the next refresh tries again
                    _log.debug("could not refresh the GPU pane's picture", exc_info=True)
