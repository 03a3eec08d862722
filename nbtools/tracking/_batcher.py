"""Background writer that moves metric values from the training thread to MLflow in batches.

The training thread appends a tuple to a deque; one daemon thread per run wakes
every ``interval`` seconds, or when a flush is requested or the queue is full,
and writes what has accumulated (:func:`~nbtools.tracking._store.write_metrics`).

Invariants:

- Bounded memory. At most ``max_pending`` values wait in the queue, and at
  most as many more are in the write under way (or kept for a retry). Past that
  high-water mark the caller waits for the writer (back-pressure) while the
  store accepts values; while the store is failing, a value past the mark is
  dropped and counted instead, so a dead tracking server never stops training.
- A store that cannot be reached (or refuses the whole run, e.g. a deleted
  run) loses nothing: the batch is kept and retried on the next wake.
- A store that refuses some values (HTTP 400 on a run that accepts writes) has
  the batch split in halves until the offending values are isolated; only those
  are dropped, with a warning, and everything else is written.
- Nothing dropped passes as success: :meth:`flush` and :meth:`close` raise
  :class:`~nbtools.errors.TrackingError` saying how many values were dropped.
- :meth:`close` returns within its timeout; what was not written by then is
  counted in its error.
- Values at steps the run already holds for that metric (a resumed run whose
  steps since the checkpoint run again) are skipped, not written twice.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.errors import TrackingError, TrackingStoreError
from nbtools.tracking._local_store import is_permanent
from nbtools.tracking._run import RunHandle
from nbtools.tracking._store import is_rejection, write_metrics

__all__ = ["MetricBatcher", "DEFAULT_MAX_PENDING"]

_log = get_logger("tracking")

#: Values the queue holds before the caller waits (or, while the store fails, values are dropped).
DEFAULT_MAX_PENDING = 100_000
# Values taken into one write; MLflow splits them into requests of 1,000.
_MAX_PER_WRITE = 10_000
# Pause between the last tries of a closing writer whose store fails.
_CLOSE_RETRY_PAUSE = 1.0


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
        handle: The run that receives the metrics; values queue while it is being
            opened, and the writer starts writing once it is open.
        interval: Seconds between writes when nobody asks for a flush.
        max_pending: Values queued before :meth:`put` waits (see the module's invariants).

    The thread is named ``nbtools-mlflow-<first 8 characters of the run id>`` once
    the run is open.
    """

    def __init__(
        self,
        handle: RunHandle,
        interval: float = 1.0,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval!r}")
        self._handle = handle
        self._client: Any = None
        self._uri = handle.uri
        self._run_id: str | None = None
        self._interval = float(interval)
        self._high = int(max_pending)
        self._queue: deque[Any] = deque()
        self._retry: list[Any] = []  # Metric entities whose write failed, oldest first
        self._unwritten: list[Any] | None = None  # what a failed split write left to retry
        self._in_flight = 0  # values taken by the write under way
        self._error: BaseException | None = None
        self._failures = 0  # writes that failed; flush() compares it before and after
        self._dropped = 0  # values dropped (refused by the store, or past the bound while failing)
        self._reported = 0  # of those, already reported by flush() or close()
        self._last_drop = ""
        self._held: dict[str, set[int]] | None = {} if handle.resumed else None
        self.unchecked: set[str] = set()  # keys whose steps are not checked against the run
        self._skipped = 0
        self._wake = threading.Event()
        self._room = threading.Condition()
        self._stopping = False
        self._deadline = float("inf")
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nbtools-mlflow-writer", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------

    def put(self, item: tuple[Any, ...]) -> None:
        """Enqueue ``(key, value, timestamp_ms, step)``; waits only past the high-water mark."""
        queue = self._queue
        if len(queue) >= self._high and not self._make_room():
            return
        queue.append(item)

    def _make_room(self) -> bool:
        with self._room:
            self._wake.set()
            while len(self._queue) >= self._high and self._error is None and not self._stopping:
                self._room.wait(0.5)
            if len(self._queue) < self._high:
                return True
            self._dropped += 1
            if self._dropped - self._reported == 1:
                _log.warning(
                    "the MLflow queue is full (%d values) while the store fails (%s); further "
                    "values are dropped and counted until it accepts writes again",
                    self._high,
                    self._error,
                )
            self._last_drop = f"the queue was full while the store failed ({self._error})"
            return False

    @property
    def pending(self) -> int:
        """Values queued or waiting for a retry (approximate while the writer runs)."""
        return len(self._queue) + max(len(self._retry), self._in_flight)

    def _queued_values(self) -> int:
        """Values in the queue, not counting the markers of flushes waiting in it."""
        return sum(1 for item in self._queue if not isinstance(item, threading.Event))

    @property
    def dropped(self) -> int:
        """Values dropped so far (refused by the store, or past the bound while it failed)."""
        return self._dropped

    @property
    def skipped(self) -> int:
        """Values not written because the run already held a value at that step."""
        return self._skipped

    def flush(self, timeout: float | None = None) -> None:
        """Block until every value queued before this call is written.

        Raises:
            TrackingError: Writing failed (the values are kept and retried), values
                were dropped, or ``timeout`` passed first.
        """
        if self._closed:
            self._raise_if_failed()
            return
        failures = self._failures
        done = threading.Event()
        self._queue.append(done)
        self._wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.05):
            if self._failures != failures or not self._thread.is_alive():
                break  # the store fails: say so now instead of waiting for a retry
            if deadline is not None and time.monotonic() >= deadline:
                raise TrackingError(
                    f"MLflow did not accept the queued metrics within {timeout} s; they stay "
                    "queued and are written in the background (check the tracking server)"
                )
        self._raise_if_failed()

    def close(self, timeout: float) -> None:
        """Write what is queued within ``timeout`` seconds, then stop the thread. Idempotent.

        Raises:
            TrackingError: Some values could not be written (their number is in the message).
        """
        if not self._closed:
            self._deadline = time.monotonic() + timeout
            self._stopping = True
            with self._room:
                self._room.notify_all()
            self._wake.set()
            self._thread.join(timeout + 0.5)
            # A writer still inside one bounded request finishes it and writes no more.
            self._closed = True
            lost = self._queued_values() + max(len(self._retry), self._in_flight)
            self._queue.clear()
            self._retry = []
            if lost:
                self._dropped += lost
                self._last_drop = (
                    f"not written within {timeout:g} s of close ({self._error or 'still writing'})"
                )
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        failed = self._handle.failed
        if failed is not None:
            lost = self._dropped - self._reported + self._queued_values()
            self._reported = self._dropped
            raise type(failed)(
                f"{failed}; the {lost} metric values logged are not in MLflow"
                if lost
                else str(failed)
            ) from failed
        new_drops = self._dropped - self._reported
        if new_drops:
            self._reported = self._dropped
            raise TrackingError(
                f"{new_drops} metric values were dropped and are not in MLflow run "
                f"{self._run_id}: {self._last_drop}"
            ) from self._error
        error = self._error
        if error is not None and self._retry:
            if is_permanent(error):
                raise TrackingStoreError(
                    f"MLflow run {self._run_id} cannot be written ({error}); retrying does not "
                    f"help: {self.pending} values are kept until close; make the store writable"
                ) from error
            raise TrackingError(
                f"writing metrics to MLflow run {self._run_id} failed ({error}); "
                f"{self.pending} values are kept and retried in the background"
            ) from error

    # -- writer thread --------------------------------------------------------

    def _run(self) -> None:
        if not self._open():
            return
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stopping:
                break
            self._drain()
        while True:  # closing: keep trying until everything is written or the time is up
            if self._drain() or time.monotonic() + _CLOSE_RETRY_PAUSE >= self._deadline:
                return
            if self._error is not None and is_permanent(self._error):
                return  # a read-only store stays read-only: close reports it at once
            time.sleep(_CLOSE_RETRY_PAUSE)

    def _open(self) -> bool:
        """Wait for the run (until close's deadline); False when it could not be opened in time."""
        handle = self._handle
        while not handle.ready:
            if self._stopping and time.monotonic() >= self._deadline:
                return False
            handle.settled(0.1)
        if handle.failed is not None:
            self._error = handle.failed
            self._failures += 1
            with self._room:
                self._room.notify_all()  # callers waiting for room drop and count instead
            return False
        self._client = handle.client
        self._run_id = handle.wait().info.run_id
        threading.current_thread().name = f"nbtools-mlflow-{self._run_id[:8]}"
        return True

    def _take(self, limit: int, waiters: list[threading.Event]) -> list[Any]:
        """Move up to ``limit`` queued values into a list of Metric entities."""
        from mlflow.entities import Metric

        batch: list[Any] = []
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
                    key,
                    step,
                    type(value).__name__,
                    exc,
                )
        with self._room:
            self._room.notify_all()
        return batch

    def _drain(self) -> bool:
        """Write until the queue is empty; False when the store failed (the batch is kept)."""
        while True:
            if self._closed:
                return True  # abandoned by close(): write nothing more
            waiters: list[threading.Event] = []
            batch = self._retry or self._take(min(_MAX_PER_WRITE, self._high), waiters)
            ok = True
            if batch:
                self._in_flight, self._unwritten = len(batch), None
                try:
                    self._write(self._new_steps(batch))
                    self._retry, self._error = [], None
                except Exception as exc:  # noqa: BLE001 - kept, retried and reported, never lost
                    if self._error is None:
                        _log.warning(
                            "writing %d metrics to MLflow failed, will retry: %s", len(batch), exc
                        )
                    self._retry = batch if self._unwritten is None else self._unwritten
                    self._error = exc
                    self._failures += 1
                    ok = False
                finally:
                    self._in_flight = 0
            for waiter in waiters:
                waiter.set()
            if not ok:
                return False
            if not self._queue and not self._retry:
                return True

    def _new_steps(self, batch: list[Any]) -> list[Any]:
        """Leave out values at steps the (resumed) run already holds for their metric."""
        held = self._held
        if held is None:
            return batch
        for key in {m.key for m in batch} - held.keys() - self.unchecked:
            held[key] = {m.step for m in self._client.get_metric_history(self._run_id, key)}
        fresh = [m for m in batch if m.key in self.unchecked or m.step not in held[m.key]]
        if len(fresh) != len(batch):
            self._skipped += len(batch) - len(fresh)
            _log.debug("skipped %d values at steps the run already holds", len(batch) - len(fresh))
        return fresh

    def _write(self, batch: list[Any]) -> None:
        """Write ``batch``; when the store refuses part of it, drop only the values it refuses."""
        if not batch:
            return
        run_id = self._run_id
        assert run_id is not None  # values are written only once the run is open
        try:
            write_metrics(self._client, self._uri, run_id, batch)
            return
        except Exception as exc:
            if not is_rejection(exc) or not self._run_accepts_writes():
                raise
        parts = [batch[len(batch) // 2 :], batch[: len(batch) // 2]]
        while parts:  # halve until each refused value stands alone
            part = parts.pop()
            try:
                write_metrics(self._client, self._uri, run_id, part)
            except Exception as exc:
                if not is_rejection(exc):
                    self._unwritten = [m for p in reversed(parts) for m in p] + part
                    raise
                if len(part) > 1:
                    parts += [part[len(part) // 2 :], part[: len(part) // 2]]
                    continue
                self._dropped += 1
                self._last_drop = f"the store refused {part[0].key!r}: {exc}"
                _log.warning(
                    "MLflow refused metric %r at step %d; dropped it: %s",
                    part[0].key,
                    part[0].step,
                    exc,
                )

    def _run_accepts_writes(self) -> bool:
        """True when the run is there and active, so a refusal is about the values themselves."""
        try:
            info = self._client.get_run(self._run_id).info
        except Exception:  # noqa: BLE001 - unknown: keep everything and retry
            return False
        return info.lifecycle_stage == "active"
