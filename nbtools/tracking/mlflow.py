"""MLflow run tracking that costs the training loop microseconds, not milliseconds.

:class:`MlflowLogger` starts (or resumes) an MLflow run and makes it the active
run, so ``mlflow.log_param`` and ``mlflow.log_artifact`` from user code land in
the same run. A store in this process (sqlite, files, a database) is opened in
the background, so the constructor returns at once. Metric values are handed to
a background thread that writes them with ``log_batch``; the training thread
only appends to a queue.

Example:
    >>> ckpt = CheckpointManager(root, every=100)                    # doctest: +SKIP
    >>> start = ckpt.restore(model=model)                              # doctest: +SKIP
    >>> with MlflowLogger(run_id=ckpt.mlflow_run_id, log_every=10) as run:  # doctest: +SKIP
    ...     for step in range(start, 10_000):
    ...         run.log_metric("loss", train_step(), step=step)
    ...         ckpt.maybe_save(step, model=model)
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import mlflow
from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException

from nbtools._internal.log import get_logger
from nbtools._internal.runinfo import register_run_id_provider
from nbtools.errors import TrackingError
from nbtools.runtime import is_main_process
from nbtools.tracking._batcher import DEFAULT_MAX_PENDING, MetricBatcher
from nbtools.tracking._events import EventsRecorder
from nbtools.tracking._run import RunHandle, end_run, leave, open_run
from nbtools.tracking._values import (
    MAX_STEPS_PER_METRIC,
    StepLimit,
    check_metric_name,
    prepare_value,
)

__all__ = ["MlflowLogger", "current_run_id", "MAX_STEPS_PER_METRIC"]

_log = get_logger("tracking")

#: Seconds :meth:`MlflowLogger.close` waits at most for the queued values by default.
DEFAULT_CLOSE_TIMEOUT = 30.0

_open_loggers: weakref.WeakSet[MlflowLogger] = weakref.WeakSet()
_current: MlflowLogger | None = None
_lock = threading.Lock()


def current_run_id() -> str | None:
    """Run id of the most recently started :class:`MlflowLogger` still open in this process."""
    current = _current
    if current is None or current.closed or current.failed is not None:
        return None
    return current.run_id


register_run_id_provider(current_run_id)


def _status_for(exc_type: type[BaseException] | None) -> str:
    if exc_type is None:
        return "FINISHED"
    if issubclass(exc_type, KeyboardInterrupt):
        return "KILLED"
    return "FAILED"


class MlflowLogger:
    """An MLflow run for a training loop: started or resumed, batched, rank-zero.

    Args:
        experiment_name: Experiment of a new run. Default: ``MLFLOW_EXPERIMENT_NAME``,
            else ``MLFLOW_EXPERIMENT_ID`` (set by ``mlflow.set_experiment``), else the
            notebook's path, else the working directory's name
            (see ``nbtools.tracking.experiment_name``).
        run_name: Name of the run (also renames a resumed run).
        run_id: Resume this run (e.g. ``CheckpointManager.mlflow_run_id``);
            default ``MLFLOW_RUN_ID``; None starts a new run. A run already active
            in this thread is adopted when no other run id is asked for.
        log_every: Keep one value in ``log_every`` steps (``step % log_every == 0``).
        total_steps: Planned number of steps, to warn at once when a metric would
            pass MLflow's limit of 10 million steps.
        rank_zero_only: Log from global rank 0 only; other ranks get a logger that
            does nothing.
        tags: Tags for the run.
        flush_interval: Seconds between background writes.
        max_pending: Values the queue holds. Past it, :meth:`log_metric` waits for
            the writer while the store accepts values (back-pressure); while the
            store fails, values past it are dropped and counted instead, so a dead
            tracking server never stops training (:meth:`flush` and :meth:`close`
            then raise, saying how many).
        close_timeout: Seconds :meth:`close` waits at most for queued values (default 30).
        events_to_mlflow: Keep the run's events (``nbtools.events``: launches, failures,
            restarts, checkpoints, input stalls, your own) that reach this process while
            the logger is open, and store them in the run as a JSON-lines artifact
            ``events/events-<start>-<id>.jsonl`` on :meth:`close`. Create the logger
            in the notebook: ranks send their events to the kernel.

    A resumed run (``run_id``, ``MLFLOW_RUN_ID``, or an adopted active run) keeps the
    values it holds: a value at a step the run already holds for that metric (steps
    that run again after a restore) is skipped. Metric names are checked against
    MLflow's rules when first logged. A tracking server that does not answer is
    reported within about 15 s, not after MLflow's four minutes of retries.

    A store in this process (a ``sqlite:``, file or database URI) is opened on a
    background thread: opening it costs 1-10 s (a new sqlite database runs its
    migrations), which the training loop does not wait for. The run is MLflow's
    active run in this thread as soon as the constructor returns; what needs the
    run itself (:attr:`run_id`, :meth:`log_params`, :meth:`flush`, :meth:`close`,
    ``mlflow.log_param``, ``mlflow.active_run().info``) waits for it, and raises
    the :class:`~nbtools.errors.TrackingError` if it could not be opened.

    Raises:
        TrackingError: The tracking server does not answer, the run to resume does
            not exist on the tracking server, or another run is active in this
            thread. For a store in this process these come from the first use
            of the run instead.
    """

    def __init__(
        self,
        experiment_name: str | None = None,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        log_every: int = 1,
        total_steps: int | None = None,
        rank_zero_only: bool = True,
        tags: Mapping[str, Any] | None = None,
        flush_interval: float = 1.0,
        max_pending: int = DEFAULT_MAX_PENDING,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        events_to_mlflow: bool = False,
    ) -> None:
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 0):
            raise ValueError(
                f"total_steps must be a non-negative integer or None, got {total_steps!r}"
            )
        if not (isinstance(flush_interval, (int, float)) and flush_interval > 0):
            raise ValueError(
                f"flush_interval must be a positive number of seconds, got {flush_interval!r}"
            )
        if not isinstance(max_pending, int) or isinstance(max_pending, bool):
            raise TypeError(f"max_pending must be an integer, got {type(max_pending).__name__}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if not isinstance(close_timeout, (int, float)) or isinstance(close_timeout, bool):
            raise TypeError(f"close_timeout must be seconds, got {type(close_timeout).__name__}")
        if not 0 <= close_timeout < float("inf"):
            raise ValueError(
                f"close_timeout must be a finite number of seconds >= 0, got {close_timeout!r}"
            )
        self._close_timeout = float(close_timeout)
        self._names: set[str] = set()  # metric names already checked
        self._log_every = log_every
        self._limit = StepLimit(log_every, total_steps)
        self._calls: dict[str, int] = {}
        self._closed = False
        self._handle: RunHandle | None = None
        self._batcher: MetricBatcher | None = None
        self._recorder: EventsRecorder | None = None
        self._skip = rank_zero_only and not is_main_process()
        if self._skip:
            return
        self._uri = mlflow.get_tracking_uri()
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        self._handle = open_run(self._uri, experiment_name, run_name, run_id, dict(tags or {}))
        self._batcher = MetricBatcher(self._handle, flush_interval, max_pending=max_pending)
        self._put = self._batcher.put
        if events_to_mlflow:
            self._recorder = EventsRecorder()
        global _current
        with _lock:
            _open_loggers.add(self)
            _current = self

    # -- run lifecycle --------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The run's id (None on ranks that do not log); waits while the run is being opened.

        Raises:
            TrackingError: The run could not be opened.
        """
        return None if self._handle is None else self._handle.wait().info.run_id

    @property
    def experiment_id(self) -> str | None:
        """The run's experiment id (None on ranks that do not log); waits like :attr:`run_id`."""
        return None if self._handle is None else self._handle.wait().info.experiment_id

    @property
    def failed(self) -> TrackingError | None:
        """Why the run could not be opened, once known; None while it opens or once open."""
        return None if self._handle is None else self._handle.failed

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    @property
    def enabled(self) -> bool:
        """False on ranks that do not log (see ``rank_zero_only``)."""
        return not self._skip

    @property
    def pending(self) -> int:
        """Metric values queued or being written (at most twice ``max_pending``)."""
        return 0 if self._batcher is None else self._batcher.pending

    @property
    def dropped(self) -> int:
        """Metric values dropped so far: refused by the store, or not written in time by :meth:`close`."""
        return 0 if self._batcher is None else self._batcher.dropped

    def flush(self, timeout: float | None = None) -> None:
        """Block until every metric logged so far is in the tracking store.

        Raises:
            TrackingError: Writing failed (the values are kept and retried), or
                values were dropped since the last report (the message says how many).
        """
        if self._batcher is not None:
            self._batcher.flush(timeout)

    def close(self, status: str = "FINISHED", timeout: float | None = None) -> None:
        """Write what is queued, stop the writer thread and end the run. Idempotent.

        Returns within ``timeout`` seconds (default ``close_timeout``, 30 s), plus,
        for a tracking server, one bounded request to mark the run ended (about 3 s
        when the server refuses connections, at most 33 s when it does not answer).

        Args:
            status: ``FINISHED``, ``FAILED`` or ``KILLED``. A run adopted from the
                caller (already active when the logger started) is left running.
            timeout: Seconds to wait for the queued values.

        Raises:
            TrackingError: Some metric values were not written (the message says how
                many), the events could not be stored, or the run could not be marked ended.
        """
        global _current
        if self._closed:
            return
        self._closed = True
        handle = self._handle
        if handle is None or self._batcher is None:
            return
        errors: list[TrackingError] = []
        try:
            try:
                self._batcher.close(self._close_timeout if timeout is None else timeout)
            except TrackingError as exc:
                errors.append(exc)
            handle.settled()
            if handle.failed is not None:
                leave(handle)  # no run to end: take its stand-in off MLflow's run stack
                errors = errors or [handle.failed]
            else:
                if self._recorder is not None:
                    try:
                        self._recorder.write(handle.client, self._uri, self.run_id)  # type: ignore[arg-type]
                    except TrackingError as exc:
                        errors.append(exc)
                if handle.owned:
                    try:
                        end_run(handle, status)
                    except TrackingError as exc:
                        errors.append(exc)
        finally:
            with _lock:
                _open_loggers.discard(self)
                if _current is self:
                    _current = None
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise TrackingError("; and ".join(str(e) for e in errors)) from errors[0]

    def __enter__(self) -> MlflowLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        self.close(_status_for(exc_type))

    def __getstate__(self) -> dict[Any, Any]:
        raise TypeError(
            "an MlflowLogger cannot be sent to another process; create one inside the "
            "function, passing run_id=logger.run_id to log into the same run"
        )

    def __repr__(self) -> str:
        if self._skip:
            return "MlflowLogger(disabled)"
        handle = self._handle
        if not handle.ready:  # type: ignore[union-attr]
            return "MlflowLogger(run opening)"
        if handle.failed is not None:  # type: ignore[union-attr]
            return f"MlflowLogger(failed: {handle.failed})"  # type: ignore[union-attr]
        return f"MlflowLogger(run_id={self.run_id!r}, {'closed' if self._closed else 'open'})"

    # -- logging --------------------------------------------------------------

    def log_metric(
        self, key: str, value: Any, step: int | None = None, timestamp: int | None = None
    ) -> None:
        """Queue one metric value; returns in microseconds, never touches the network.

        Args:
            key: Metric name.
            value: A number, or a one-element tensor (converted in the background,
                so a CUDA tensor does not synchronise the training thread).
            step: Training step; default: how many times ``key`` was logged before.
                Values whose step is not a multiple of ``log_every`` are skipped.
            timestamp: Milliseconds since the epoch; default now.

        Raises:
            TypeError: ``key`` is not a string, or ``value`` not a number.
            ValueError: MLflow would refuse the name (checked once per name), or
                ``value`` is a tensor of more than one element.
        """
        if self._skip or self._closed:
            self._check_open()
            return
        if key not in self._names:
            check_metric_name(key)  # before anything is queued: MLflow would refuse the batch
            self._names.add(key)
        if step is None:
            step = self._calls.get(key, 0)
            self._calls[key] = step + 1
        if step % self._log_every:
            return
        if step >= self._limit.warn_at:
            self._limit.passing(key, step)
        if type(value) is not float:
            value = prepare_value(key, value)
        self._put((key, value, timestamp or int(time.time() * 1000), step))

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Queue several metric values for the same step (see :meth:`log_metric`)."""
        timestamp = int(time.time() * 1000)
        for key, value in metrics.items():
            self.log_metric(key, value, step, timestamp)

    def _enqueue(self, key: str, value: float, step: int, timestamp: int) -> None:
        """Queue a value as is, without throttling (for system metrics, whose steps restart)."""
        if not (self._skip or self._closed):
            if key not in self._names:
                self._names.add(key)
                self._batcher.unchecked.add(key)  # type: ignore[union-attr]
            self._put((key, value, timestamp, step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log parameters now (synchronously: they are few and must not silently fail)."""
        self._log_now(params=[Param(str(k), str(v)) for k, v in params.items()])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set tags on the run now."""
        self._log_now(tags=[RunTag(str(k), str(v)) for k, v in tags.items()])

    def _log_now(self, **entities: Any) -> None:
        if self._skip or self._closed:
            self._check_open()
            return
        try:
            self._handle.client.log_batch(self.run_id, **entities)  # type: ignore[union-attr]
        except MlflowException as exc:
            raise TrackingError(
                f"MLflow run {self.run_id} refused the values: {exc.message}"
            ) from exc

    def _check_open(self) -> None:
        if self._closed and not self._skip:
            raise TrackingError(
                f"MlflowLogger for run {self.run_id} is closed; start a new one with "
                f"run_id={self.run_id!r} to keep logging into this run"
            )


@atexit.register
def _close_all() -> None:
    """Flush and end every open logger when the interpreter exits (runs before MLflow's own hook)."""
    for logger in list(_open_loggers):
        try:
            logger.close()
        except Exception as exc:  # noqa: BLE001 - exiting: report, keep closing the others
            _log.warning("could not close MLflow run %s at exit: %s", logger.run_id, exc)
