"""The kernel's end of the local channel: a named pipe and the thread that reads it.

The collector creates the FIFO in a private directory and opens it for reading
(non-blocking) before any rank starts, so a rank's non-blocking open for
writing succeeds. It also keeps a write end of its own open: without a writer a
FIFO reads as end-of-file and ``poll`` reports a hang-up on every call.

Ordering guarantee: ``drain`` and ``stop`` deliver every byte that was in the
pipe when they were called (``FIONREAD``), so once a rank has exited, a later
``drain`` has published all it sent. A batch is one atomic write, so the bytes
present at that moment are whole batches.
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import shutil
import tempfile
import termios
import threading
import uuid
from types import TracebackType

from nbtools._internal.log import get_logger
from nbtools.events import _ask
from nbtools.events._bus import Bus
from nbtools.events._emit import BUS
from nbtools.events._sinks import CHANNEL_ENV
from nbtools.events._wire import BATCH_BYTES, decode_batch

__all__ = ["Collector"]

_log = get_logger("events")

_THREAD_NAME = "nbtools-events-collector"
_PIPE_BYTES = 1 << 20  # room for bursts while the reader waits for the GIL
_READ_BYTES = 1 << 16
_PASS_BYTES = 1 << 20  # per pass of the reader thread, so that drain() gets its turn
_JOIN_S = 5.0
_WARNED_SOURCES = 64  # bounded: a writer that forges a new pid per line gets no more lines


class Collector:
    """Receives the events of ranks through a named pipe and publishes them on a bus.

    Args:
        directory: A private directory of the run for the pipe; by default a
            new temporary directory, removed by ``stop``.
        bus: Where events go; by default the bus that ``events.log()`` reads.

    Example:
        >>> collector = Collector().start()
        >>> env = collector.environment()   # pass to each rank's environment
        >>> # ... ranks run, emit, exit ...
        >>> collector.stop()                # everything they sent is on the bus
    """

    def __init__(
        self, directory: str | os.PathLike | None = None, *, bus: Bus | None = None
    ) -> None:
        if bus is not None and not isinstance(bus, Bus):
            raise TypeError(f"bus must be an nbtools.events.Bus, not {type(bus).__name__}")
        self._directory = None if directory is None else os.fspath(directory)
        self.bus = bus if bus is not None else BUS
        self.path: str | None = None
        self._own_dir: str | None = None
        self._rfd = self._wfd = self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one reader at a time: a batch is published whole
        self._partial = b""
        self._stopping = False
        self._warned: set[tuple] = set()  # sources already warned about (one line each)

    # --- life cycle ------------------------------------------------------------

    def start(self) -> Collector:
        """Create the pipe and start reading it; returns self. Starting twice is harmless."""
        if self._thread is not None:
            return self
        directory = self._directory
        if directory is None:
            directory = self._own_dir = tempfile.mkdtemp(prefix="nbtools-events-")
        elif not os.path.isdir(directory):
            raise ValueError(f"Collector directory {directory!r} does not exist; create it first")
        path = os.path.join(directory, f"events-{uuid.uuid4().hex[:8]}.fifo")
        try:
            os.mkfifo(path, 0o600)
            self.path = path
            self._rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._wfd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._wake_r, self._wake_w = os.pipe()
            try:
                fcntl.fcntl(self._rfd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            except (AttributeError, OSError):
                pass  # the default 64 KiB still works; bursts drop sooner
            self._stopping = False
            _ask.register(_ask.ask_path(f"fifo:{path}") or "")  # the kernel asks through it
            self._thread = threading.Thread(target=self._loop, name=_THREAD_NAME, daemon=True)
            self._thread.start()
        except BaseException:
            self._release()
            raise
        return self

    def environment(self) -> dict[str, str]:
        """The environment variables a rank needs to send its events here (starts if needed).

        Besides the channel, torch's Flight Recorder is switched on
        (``TORCH_FR_BUFFER_SIZE``, unless this process's environment sets it),
        so that a hang report can name the collective each rank is in.
        """
        self.start()
        env = {CHANNEL_ENV: f"fifo:{self.path}"}
        if _ask.BUFFER_ENV not in os.environ:
            env[_ask.BUFFER_ENV] = _ask.BUFFER_SIZE
        return env

    def ask(self) -> bool:
        """Ask the ranks sending here which collective they are in; their answers follow.

        Each rank's events thread notices within a second and sends one
        ``collectives`` event per process group (see the watchdog's hang
        reports). False when the collector is not running.
        """
        if self.path is None or self._thread is None:
            return False
        return _ask.touch(_ask.ask_path(f"fifo:{self.path}") or "")

    def drain(self) -> int:
        """Publish everything written to the pipe before this call; return the events published."""
        with self._lock:
            if self._rfd < 0:
                return 0
            return self._read(_bytes_waiting(self._rfd))

    def stop(self) -> None:
        """Publish everything written so far, stop reading and remove the pipe. Idempotent."""
        thread = self._thread
        if thread is not None:
            self._stopping = True
            os.write(self._wake_w, b"x")
            thread.join(_JOIN_S)
            if thread.is_alive():  # pragma: no cover - a subscriber that never returns
                _log.warning("the events reader did not stop within %.0f s", _JOIN_S)
        self.drain()
        self._release()

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- reading -----------------------------------------------------------------

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._rfd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping:
            poller.poll(1000)
            if self._stopping:
                break
            try:
                with self._lock:
                    self._read(_PASS_BYTES)
            except Exception:  # noqa: BLE001 - the reader must outlive one bad batch
                _log.exception("reading events failed; the reader goes on")

    def _read(self, budget: int) -> int:
        """Read up to ``budget`` bytes (less when the pipe empties) and publish whole batches."""
        published = 0
        while budget > 0:
            try:
                chunk = os.read(self._rfd, min(_READ_BYTES, budget))
            except BlockingIOError:
                break
            if not chunk:
                break
            budget -= len(chunk)
            published += self._publish(chunk)
        return published

    def _publish(self, chunk: bytes) -> int:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > BATCH_BYTES:
            # No batch is this long: a stray writer; skip to the next newline.
            self.bus.count_malformed()
            self._partial = b""
        published = 0
        for line in lines:
            if not line:
                continue
            try:
                batch = decode_batch(line)
            except ValueError as exc:
                self.bus.count_malformed()
                _log.warning("ignored a message on the events pipe: %s", exc)
                continue
            if batch.rejected:
                self.bus.count_rejected(batch.rejected)
                self._warn_rejected(batch.source, batch.rejected)
            self.bus.publish(batch.events, dropped=batch.dropped, source=batch.source)
            published += len(batch.events)
        return published

    def _warn_rejected(self, source: tuple, count: int) -> None:
        # One line per writing process, not one per bad event: a broken writer
        # must not flood the cell. The bus counts every one (Bus.rejected()).
        if source in self._warned or len(self._warned) >= _WARNED_SOURCES:
            return
        self._warned.add(source)
        host, rank, pid = source
        _log.warning(
            "left out %d invalid event(s) from pid %s on %s (rank %s): an event needs a numeric "
            "time, a kind name and scalar fields; later ones from it are counted in "
            "events.bus().rejected()",
            count,
            pid,
            host,
            rank,
        )

    def _release(self) -> None:
        for name in ("_rfd", "_wfd", "_wake_r", "_wake_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        self._thread = None
        self._partial = b""
        if self.path is not None:
            _ask.unregister(_ask.ask_path(f"fifo:{self.path}") or "")
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None


def _bytes_waiting(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    return buf[0]
