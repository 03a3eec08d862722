"""Polls a backend on a background thread, keeps the history, pauses when idle.

Invariants:

- Reading the GPUs never happens on the caller's thread except for an
  explicit :meth:`Sampler.refresh`; cell execution is never blocked.
- The sampler is idle when no cell is running, and neither a cell nor the
  pane has been used for ``idle_timeout`` seconds. Then it stops polling and
  says so; any use (:meth:`touch`, :meth:`refresh`, :meth:`resume`, a cell)
  starts it again. A cell that runs for hours is activity the whole time.
- Scheduling reads only the injected ``clock``, so tests drive it with a fake
  clock through :meth:`tick` without a thread.
- Samplers are shared per backend key (:func:`acquire`/:func:`release`):
  two panes on the same GPUs do not poll twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.errors import MonitorError
from nbtools.monitor.backends import Backend, BackendUnavailable
from nbtools.monitor.history import History
from nbtools.monitor.readings import Sample
from nbtools.monitor.timing import (
    DEFAULT_HISTORY_SECONDS,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_INTERVAL,
    history_points,
)

__all__ = ["Sampler", "SampleSink", "StatusWatcher", "acquire", "release", "THREAD_NAME"]

_log = get_logger("monitor")

#: Name of every sampler thread (tests and leak checks look for it).
THREAD_NAME = "nbtools-gpu-sampler"
#: Called with each new sample, on the thread that took it. MLflow logging plugs in here.
SampleSink = Callable[[Sample], None]
#: Called with ``(status, message)`` whenever the status changes.
StatusWatcher = Callable[[str, str], None]

_WAIT_FOREVER = 3600.0  # a paused sampler sleeps until woken; this only bounds one wait


def _fmt_minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


class Sampler:
    """Polls ``backend`` every ``interval`` seconds and keeps ``history_seconds`` of samples.

    Args:
        backend: Where readings come from (:class:`NVMLBackend`, :class:`SimulatedBackend`).
        interval: Seconds between polls (at least ``MIN_INTERVAL``, 0.01).
        history_seconds: Seconds of history to keep, in :attr:`samples`: a ring of
            ``ceil(history_seconds / interval) + 1`` samples per host, capped at
            ``MAX_HISTORY_POINTS`` (see :mod:`nbtools.monitor.timing`).
        idle_timeout: Seconds without activity before polling pauses; ``None`` never pauses.
        clock: Returns the time in seconds since the epoch; samples are stamped with it.
        start: Start the background thread (False: call :meth:`tick` yourself, as tests do).

    Example:
        >>> from nbtools.monitor import SimulatedBackend
        >>> sampler = Sampler(SimulatedBackend(2), interval=1.0, start=False)
        >>> sampler.refresh().gpus[0].name
        'Simulated GPU 0'
        >>> sampler.close()
    """

    def __init__(
        self,
        backend: Backend,
        *,
        interval: float = DEFAULT_INTERVAL,
        history_seconds: float = DEFAULT_HISTORY_SECONDS,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        clock: Callable[[], float] = time.time,
        start: bool = True,
    ) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend must provide key, source, host, open(), read(now) and close(); "
                f"got {type(backend).__name__}"
            )
        points = history_points(interval, history_seconds, idle_timeout)
        self.backend = backend
        self.interval = float(interval)
        self.history_seconds = float(history_seconds)
        self.idle_timeout = None if idle_timeout is None else float(idle_timeout)
        #: The samples kept: a bounded ring per host.
        self.samples = History(points)
        self._clock = clock
        self._start = start
        self._lock = threading.RLock()
        self._read_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._sinks: list[SampleSink] = []
        self._watchers: list[StatusWatcher] = []
        self._failed_sinks: set[int] = set()
        self._busy = False
        self._last_activity = clock()
        self._next_due = self._last_activity
        self.last_sample: Sample | None = None
        self._status: str = "polling"
        self._reason: str | None = None
        self._message = ""
        if self._open_backend() and start:
            self._poll(clock())  # the first sample is there when the constructor returns
        self._ensure_thread()

    # --- state --------------------------------------------------------------

    @property
    def status(self) -> str:
        """``"polling"``, ``"paused"``, ``"unavailable"`` or ``"closed"``."""
        return self._status

    @property
    def message(self) -> str:
        """Why the sampler is paused or unavailable, in plain words (``""`` while polling)."""
        return self._message

    @property
    def paused_reason(self) -> str | None:
        """``"idle"`` or ``"user"`` while paused, else None."""
        return self._reason if self._status == "paused" else None

    @property
    def simulated(self) -> bool:
        """True when the backend makes its numbers up."""
        return self.backend.source == "simulated"

    def _set_status(self, status: str, reason: str | None = None, message: str = "") -> None:
        with self._lock:
            if (status, reason, message) == (self._status, self._reason, self._message):
                return
            self._status, self._reason, self._message = status, reason, message
            watchers = list(self._watchers)
        self._wake.set()
        for watcher in watchers:
            try:
                watcher(status, message)
            except Exception:  # noqa: BLE001 - a broken view must not stop the sampler
                _log.exception("GPU monitor status watcher failed")

    def _open_backend(self) -> bool:
        try:
            self.backend.open()
        except BackendUnavailable as err:
            self._set_status("unavailable", None, str(err))
            return False
        return True

    def _ensure_thread(self) -> None:
        with self._lock:
            if not self._start or self._status in ("closed", "unavailable"):
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    # --- subscribers ----------------------------------------------------------

    def add_sink(self, sink: SampleSink) -> None:
        """Call ``sink(sample)`` with every new sample (local polls and :meth:`ingest`).

        Sinks run on the thread that took the sample and must be quick; an
        exception is logged once and the sink stays registered.
        """
        with self._lock:
            self._sinks.append(sink)

    def remove_sink(self, sink: SampleSink) -> None:
        """Stop calling ``sink`` (no error when it was not registered)."""
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    def add_watcher(self, watcher: StatusWatcher) -> None:
        """Call ``watcher(status, message)`` whenever the status changes."""
        with self._lock:
            self._watchers.append(watcher)

    def remove_watcher(self, watcher: StatusWatcher) -> None:
        """Stop calling ``watcher``."""
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def _emit(self, sample: Sample) -> None:
        with self._lock:
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink(sample)
            except Exception:  # noqa: BLE001 - a broken sink must not stop the sampler
                if id(sink) not in self._failed_sinks:
                    self._failed_sinks.add(id(sink))
                    _log.exception("GPU monitor sink %r failed; it stays registered", sink)

    # --- activity -------------------------------------------------------------

    def touch(self) -> None:
        """Record activity now; an idle-paused sampler resumes polling."""
        with self._lock:
            self._last_activity = self._clock()
            resume = self._status == "paused" and self._reason == "idle"
        if resume:
            self._set_status("polling")
        self._wake.set()

    def set_busy(self, busy: bool) -> None:
        """Mark a cell as running (``True``) or finished; a running cell is activity throughout."""
        with self._lock:
            self._busy = bool(busy)
        self.touch()

    def _idle(self, now: float) -> bool:
        return (
            self.idle_timeout is not None
            and not self._busy
            and now - self._last_activity >= self.idle_timeout
        )

    # --- polling --------------------------------------------------------------

    def tick(self) -> float:
        """Do what is due now (pause when idle, poll when due); return seconds until the next tick."""
        now = self._clock()
        with self._lock:
            if self._status != "polling":
                return _WAIT_FOREVER
            idle = self._idle(now)
            due = now >= self._next_due or now < self._next_due - self.interval  # clock went back
        if idle:
            self._set_status(
                "paused",
                "idle",
                f"paused: no cell has run and the pane was not used for "
                f"{_fmt_minutes(self.idle_timeout or 0)}; press Refresh or Resume, or run a cell",
            )
            return _WAIT_FOREVER
        if due:
            self._poll(now)
        with self._lock:
            delay = self._next_due - now
            if self.idle_timeout is not None and not self._busy:
                delay = min(delay, self._last_activity + self.idle_timeout - now)
        return max(0.0, min(delay, _WAIT_FOREVER))

    def _poll(self, now: float) -> Sample | None:
        # A backend that reads several hosts (a cluster) returns one sample per host.
        read_samples = getattr(self.backend, "read_samples", None)
        with self._read_lock:
            try:
                if read_samples is not None:
                    samples = list(read_samples(now))
                else:
                    readings = self.backend.read(now)
                    samples = [Sample(self.backend.host, now, tuple(readings), self.backend.source)]
            except BackendUnavailable as err:
                self._set_status("unavailable", None, str(err))
                return None
            except Exception as err:  # noqa: BLE001 - a failing driver call must not reach the cell
                _log.exception("reading the GPUs failed")
                self._set_status("unavailable", None, f"reading the GPUs failed: {err}")
                return None
        with self._lock:
            self._next_due = now + self.interval
            if samples:
                self.last_sample = samples[-1]
        for sample in samples:
            self.samples.add(sample)
            self._emit(sample)
        return samples[-1] if samples else None

    def _run(self) -> None:
        while self._status != "closed":
            delay = self.tick()
            self._wake.wait(delay)
            self._wake.clear()

    # --- user actions -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._status == "closed":
            raise MonitorError("this GPU monitor is closed; create a new GPUPane to watch the GPUs")

    def refresh(self) -> Sample | None:
        """Sample every GPU now, on the caller's thread; counts as activity.

        When the GPUs could not be read, or the backend lost some of them
        (``backend.lost``), the backend is opened again first (NVML starts anew).

        Returns:
            The new sample, or None when the GPUs cannot be read (see :attr:`message`).
        """
        self._check_open()
        if self._status == "unavailable" or getattr(self.backend, "lost", None):
            # Start the backend again: NVML is re-initialised after a lost GPU or driver.
            with self._read_lock:
                opened = self._open_backend()
            if not opened:
                return None
            if self._status == "unavailable":
                self._set_status("polling")
            self._ensure_thread()
        self.touch()
        return self._poll(self._clock())

    def pause(self) -> None:
        """Stop polling until :meth:`resume` (activity does not undo this pause)."""
        self._check_open()
        if self._status != "unavailable":
            self._set_status("paused", "user", "paused by the user; press Resume to continue")

    def resume(self) -> None:
        """Poll again after :meth:`pause` or an idle pause; retry an unavailable backend."""
        self._check_open()
        if self._status == "unavailable":
            self.refresh()
            return
        with self._lock:
            self._next_due = self._clock()
        self._set_status("polling")
        self.touch()

    def ingest(self, sample: Sample) -> None:
        """Add a sample taken elsewhere (another node of the run) to the history and sinks."""
        self._check_open()
        if not isinstance(sample, Sample):
            raise TypeError(f"ingest takes a Sample, got {type(sample).__name__}")
        self.samples.add(sample)
        self._emit(sample)

    def close(self) -> None:
        """Stop the thread, release the backend and drop the subscribers (idempotent)."""
        if self._status == "closed":
            return
        self._set_status("closed")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        with self._read_lock:
            self.backend.close()
        with self._lock:
            self._sinks.clear()
            self._watchers.clear()
        _forget(self)


# --- sharing: one sampler per set of GPUs ------------------------------------

_shared: dict[str, list[Any]] = {}  # backend key -> [sampler, number of users]
_shared_lock = threading.Lock()


def acquire(
    backend: Backend,
    *,
    interval: float = DEFAULT_INTERVAL,
    history_seconds: float = DEFAULT_HISTORY_SECONDS,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    clock: Callable[[], float] = time.time,
    start: bool = True,
) -> Sampler:
    """The running sampler for ``backend.key``, or a new :class:`Sampler` with these settings.

    Each call must be matched by one :func:`release`. A sampler that already
    runs keeps its own interval and history length. The arguments are those
    of :class:`Sampler` and are checked even when a running sampler is shared.
    """
    with _shared_lock:
        entry = _shared.get(backend.key)
        if entry is not None and entry[0].status != "closed":
            history_points(
                interval, history_seconds, idle_timeout
            )  # bad input is an error here too
            entry[1] += 1
            if float(interval) != entry[0].interval:
                _log.info(
                    "the GPUs of %s are already polled every %g s; sharing that sampler",
                    backend.key,
                    entry[0].interval,
                )
            return entry[0]
        sampler = Sampler(
            backend,
            interval=interval,
            history_seconds=history_seconds,
            idle_timeout=idle_timeout,
            clock=clock,
            start=start,
        )
        _shared[backend.key] = [sampler, 1]
        return sampler


def release(sampler: Sampler) -> None:
    """Give back a sampler from :func:`acquire`; the last user's release closes it."""
    with _shared_lock:
        entry = _shared.get(sampler.backend.key)
        last = entry is None or entry[0] is not sampler or entry[1] <= 1
        if entry is not None and entry[0] is sampler:
            entry[1] -= 1
    if last:
        sampler.close()


def _forget(sampler: Sampler) -> None:
    with _shared_lock:
        entry = _shared.get(sampler.backend.key)
        if entry is not None and entry[0] is sampler:
            del _shared[sampler.backend.key]
