"""Background writer that moves metric values from the training thread to MLflow in batches.

The training thread only appends a tuple to a deque (thread-safe, lock-free under
the GIL); one daemon thread per run wakes every ``interval`` seconds, or when a
flush is requested, and writes what has accumulated with ``log_batch`` (MLflow
splits it into requests of at most 1,000 metrics). Values that fail to be written
are kept and retried, never dropped; the failure is raised to the caller at the
next :meth:`flush` or :meth:`close`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.errors import TrackingError

__all__ = ["MetricBatcher"]

_log = get_logger("tracking")

# MLflow's own limit for one request; log_batch splits larger lists, but bounding
# what one write holds keeps memory flat when a long backlog is drained.
_MAX_PER_WRITE = 10_000


def _to_float(value: Any) -> float:
    """Convert a queued value; tensors are converted here so the caller never syncs a device."""
    if type(value) is float:
        return value
    item = getattr(value, "item", None)
    if item is not None:
        return float(item())
    return float(value)


class MetricBatcher:
    """Queue of ``(key, value, timestamp_ms, step)`` written to one MLflow run by a thread.

    Args:
        client: An ``mlflow.MlflowClient`` for the run's tracking store.
        run_id: The run that receives the metrics.
        interval: Seconds between writes when nobody asks for a flush.
        name: Thread name (starts with ``nbtools-``).
    """

    def __init__(self, client: Any, run_id: str, interval: float = 1.0, name: str = "nbtools-mlflow") -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval!r}")
        self._client = client
        self._run_id = run_id
        self._interval = float(interval)
        self._queue: deque[Any] = deque()
        self._retry: list[Any] = []  # Metric entities whose write failed, oldest first
        self._error: BaseException | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------

    @property
    def put(self):
        """``put((key, value, timestamp_ms, step))``: enqueue one value; never blocks."""
        return self._queue.append

    @property
    def pending(self) -> int:
        """Values queued or waiting for a retry (approximate while the writer runs)."""
        return len(self._queue) + len(self._retry)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every value queued before this call is written.

        Raises:
            TrackingError: Writing failed (the values are kept and retried), or
                ``timeout`` passed first.
        """
        if self._closed:
            self._raise_if_failed()
            return
        done = threading.Event()
        self._queue.append(done)
        self._wake.set()
        if not done.wait(timeout):
            raise TrackingError(
                f"MLflow did not accept the queued metrics within {timeout} s; they stay "
                "queued and are written in the background (check the tracking server)"
            )
        self._raise_if_failed()

    def close(self, timeout: float | None = None) -> None:
        """Write everything still queued, then stop the thread. Idempotent.

        Raises:
            TrackingError: Some values could not be written.
        """
        if not self._closed:
            self._stopping = True
            self._wake.set()
            self._thread.join(timeout)
            self._closed = not self._thread.is_alive()
            if not self._closed:
                raise TrackingError(
                    f"the MLflow writer did not finish within {timeout} s; "
                    f"{self.pending} values are still queued"
                )
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is None:
            return
        lost = len(self._retry)
        if self._closed and lost:
            raise TrackingError(
                f"{lost} metric values could not be written to MLflow run {self._run_id}: "
                f"{error}"
            ) from error
        if not self._closed and lost:
            raise TrackingError(
                f"writing metrics to MLflow run {self._run_id} failed ({error}); "
                f"{lost} values are kept and retried in the background"
            ) from error

    # -- writer thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            stopping = self._stopping
            self._drain()
            if stopping:
                if self._error is not None:
                    self._drain()  # one more try before giving the failure to close()
                return

    def _take(self, limit: int, batch: list[Any], waiters: list[threading.Event]) -> None:
        """Move up to ``limit`` queued values into ``batch`` as Metric entities."""
        from mlflow.entities import Metric

        queue = self._queue
        while queue and len(batch) < limit:
            item = queue.popleft()
            if isinstance(item, threading.Event):
                waiters.append(item)
                continue
            key, value, timestamp, step = item
            try:
                batch.append(Metric(key, _to_float(value), timestamp, step))
            except (TypeError, ValueError, RuntimeError) as exc:
                _log.warning(
                    "dropped metric %r at step %s: a %s is not a number (%s)",
                    key, step, type(value).__name__, exc,
                )

    def _drain(self) -> None:
        while True:
            batch, self._retry = self._retry, []
            waiters: list[threading.Event] = []
            self._take(_MAX_PER_WRITE, batch, waiters)
            if batch:
                try:
                    self._client.log_batch(self._run_id, metrics=batch)
                    self._error = None
                except Exception as exc:  # noqa: BLE001 - kept, retried and reported, never lost
                    if self._error is None:
                        _log.warning("writing %d metrics to MLflow failed, will retry: %s", len(batch), exc)
                    self._error = exc
                    # Keep everything queued so far and release every waiter, so that
                    # flush() reports the failure instead of waiting for a retry.
                    self._take(len(batch) + len(self._queue) + 1, batch, waiters)
                    self._retry = batch
            for waiter in waiters:
                waiter.set()
            if self._error is not None or not self._queue:
                return
