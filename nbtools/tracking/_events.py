"""The run's events (``nbtools.events``) kept in its MLflow run as a JSON-lines artifact.

An :class:`EventsRecorder` subscribes to this process's events bus while the
logger is open (the subscriber only appends to a bounded list, on the thread
that delivers the events) and, when the logger closes, writes one JSON object
per line and logs the file under ``events/`` in the run. Each logger session
writes its own file (named by its start time and a random id), so a resumed run keeps the
events of every session.

Line format: ``time`` (seconds since the epoch), ``host``, ``rank``, ``pid``,
``kind``, ``message``, ``step``, then the event's own fields.
``pandas.read_json(path, lines=True)`` reads it back as a table.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
from collections import deque
from typing import Any

from mlflow.exceptions import MlflowException

from nbtools import events as _events
from nbtools._internal import settings
from nbtools._internal.log import get_logger
from nbtools.errors import TrackingError
from nbtools.tracking._store import bounded_requests

__all__ = ["EventsRecorder", "ARTIFACT_DIR", "MAX_RECORDED"]

_log = get_logger("tracking")

#: Folder of the run's artifacts that holds the events files.
ARTIFACT_DIR = "events"
#: Most events one logger session keeps (the newest); the count of the rest is logged.
MAX_RECORDED = 200_000


class EventsRecorder:
    """Collects the events that reach this process while a run is open.

    Args:
        started: Time the logger started (seconds since the epoch); names the file.
    """

    def __init__(self, started: float | None = None) -> None:
        self.started = time.time() if started is None else float(started)
        self._id = uuid.uuid4().hex[:8]  # sessions of one run never share a file
        self._events: deque[_events.Event] = deque(maxlen=MAX_RECORDED)
        self._seen = 0
        self._lock = threading.Lock()
        self._dropped_before = _events.dropped()
        if settings.read("NBTOOLS_EVENTS_CHANNEL"):
            _log.warning(
                "events_to_mlflow: this process is a rank, whose events go to the kernel; "
                "create the MlflowLogger with events_to_mlflow=True in the notebook to keep them"
            )
        _events.subscribe(self._arrived)

    def _arrived(self, batch: list[_events.Event]) -> None:
        # On the delivering thread: append only.
        with self._lock:
            self._events.extend(batch)
            self._seen += len(batch)

    def stop(self) -> list[_events.Event]:
        """Stop collecting; the events collected, oldest first."""
        _events.unsubscribe(self._arrived)
        with self._lock:
            kept = sorted(self._events, key=lambda e: e.time)
            if self._seen > len(kept):
                _log.warning(
                    "events_to_mlflow kept the newest %d of %d events", len(kept), self._seen
                )
        return kept

    @property
    def file_name(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.started))
        return f"events-{stamp}-{self._id}.jsonl"

    def write(self, client: Any, uri: str, run_id: str) -> int:
        """Stop collecting and log the events as ``events/<file>.jsonl``; return how many.

        Raises:
            TrackingError: The artifact store refused the file (the events stay in
                ``nbtools.events.log()`` of this process).
        """
        kept = self.stop()
        dropped = _events.dropped() - self._dropped_before
        with tempfile.TemporaryDirectory(prefix="nbtools-events-") as tmp:
            path = os.path.join(tmp, self.file_name)
            with open(path, "w", encoding="utf-8") as fh:
                for event in kept:
                    fh.write(json.dumps(_line(event), ensure_ascii=False, default=str) + "\n")
            try:
                with bounded_requests(uri):
                    client.log_artifact(run_id, path, artifact_path=ARTIFACT_DIR)
                    if dropped:
                        client.set_tag(run_id, "nbtools.events_dropped", str(dropped))
            except (MlflowException, OSError) as exc:
                raise TrackingError(
                    f"the {len(kept)} events of MLflow run {run_id} could not be stored as an "
                    f"artifact ({exc}); they are still in nbtools.events.log() of this kernel"
                ) from exc
        return len(kept)


def _line(event: _events.Event) -> dict[str, Any]:
    line = {
        "time": event.time,
        "host": event.host,
        "rank": event.rank,
        "pid": event.pid,
        "kind": event.kind,
        "message": event.message,
        "step": event.step,
    }
    line.update(event.fields)
    return line
