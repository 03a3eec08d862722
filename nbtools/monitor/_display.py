"""Where a GPU pane lives in the notebook: one output, its bundle kept current.

The pane's output is one ``display_data`` with a display id and three
representations: the live widget (``application/vnd.jupyter.widget-view+json``),
a still picture (``image/png``, :mod:`nbtools.monitor.snapshot`) and one line
of text per host (``text/plain``). A front end with the widget manager shows
the live pane; nbconvert without widget state, GitHub, nbviewer and any viewer
without JavaScript show the picture; a terminal shows the text.

The picture is redrawn by :meth:`PaneDisplay.refresh` (an explicit
``pane.snapshot()``, close) and by a worker thread when the pane pauses and
every ``SNAPSHOT_EVERY_S`` seconds while new samples come in: never on the
sampler's thread, so a poll never waits for a drawing. Each drawing goes to
the chart's ``_snapshot`` trait (what a view of saved widget state shows
without a kernel). The output itself is updated in place
(``update_display_data``) on ``snapshot()`` and close, and when the pane
pauses while no live view has spoken to the kernel (nbclient, a headless
run); never by the minute: a front end re-renders an output it is told to
update, which would redraw the live view the user is looking at. When the
pane closes, the output keeps the picture and the text only.

The same worker pushes plotly.js to the chart a moment after it is shown (see
:meth:`~nbtools.monitor._widget.GPUChart.push_library`).
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.monitor.snapshot import Snapshot

__all__ = ["PaneDisplay", "SNAPSHOT_EVERY_S", "WIDGET_VIEW", "THREAD_NAME"]

_log = get_logger("monitor")
#: Seconds between refreshes of the still picture while samples come in.
SNAPSHOT_EVERY_S = 60.0
#: Seconds after the pane is shown at which plotly.js is pushed to a view that has not said it has it.
PUSH_AFTER_S = (0.3, 3.0)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
THREAD_NAME = "nbtools-pane-display"


class PaneDisplay:
    """The output of one pane: shows it, refreshes its picture, ends with the picture.

    Args:
        widget: The pane's top widget (its model id goes in the bundle).
        chart: The pane's chart (receives the picture, and plotly.js pushes).
        take: Draws a new :class:`~nbtools.monitor.snapshot.Snapshot` of the pane.
        every: Seconds between refreshes while new samples arrive.
    """

    def __init__(self, widget: Any, chart: Any, take: Callable[[], Snapshot],
                 every: float = SNAPSHOT_EVERY_S) -> None:
        self.display_id = f"nbtools-gpu-pane-{uuid.uuid4().hex}"
        self._widget = widget
        self._chart = chart
        self._take = take
        self._every = every
        self._shown = False
        self._live = True
        self.last: Snapshot | None = None
        self._dirty = False
        self._stopped = False  # the pane paused since the worker's last drawing
        self._lock = threading.Lock()  # one drawing at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bundle(self, snapshot: Snapshot, *, live: bool = True) -> dict[str, Any]:
        """The output's representations: widget view (while live), PNG, text."""
        data: dict[str, Any] = {
            "text/plain": snapshot.text,
            "image/png": base64.b64encode(snapshot.png).decode("ascii"),
        }
        if live:
            data[WIDGET_VIEW] = {"version_major": 2, "version_minor": 0,
                                 "model_id": self._widget.model_id}
        return data

    def show(self) -> None:
        """Display the pane (IPython), or show it again: every output of it is updated together."""
        from IPython.display import display

        snapshot = self.refresh(publish=False)
        display(self.bundle(snapshot, live=self._live), raw=True, display_id=self.display_id)
        self._shown = True
        if self._live and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def refresh(self, *, publish: bool = True) -> Snapshot:
        """Draw a new picture now (caller's thread) and put it in every output of the pane."""
        with self._lock:
            self._dirty = False
            snapshot = self._take()
            self.last = snapshot
            if self._live:
                self._chart.set_snapshot(snapshot.png)
            if publish and self._shown:
                from IPython.display import update_display

                update_display(self.bundle(snapshot, live=self._live), raw=True,
                               display_id=self.display_id)
        return snapshot

    def sampled(self) -> None:
        """A new sample is in the history (cheap: the sampler's thread calls it)."""
        self._dirty = True

    def soon(self) -> None:
        """Refresh on the worker as soon as it can (the pane paused or stopped)."""
        self._dirty = True
        self._stopped = True
        self._wake.set()

    def close(self) -> None:
        """Stop the worker; the outputs keep the last picture and the text, no live view."""
        thread, self._thread = self._thread, None
        self._stop.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._live = False
        if self._shown:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - closing must not fail over a picture
                _log.warning("could not draw the GPU pane's last picture", exc_info=True)

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
                stopped, self._stopped = self._stopped, False
                try:
                    self.refresh(publish=stopped and not self._chart.library_held)
                except Exception:  # noqa: BLE001 - the next refresh tries again
                    _log.debug("could not refresh the GPU pane's picture", exc_info=True)
