"""The sending side in one process: a bounded buffer and a daemon flusher thread.

``put`` is what the training thread pays: one length check and one deque
append (both atomic under the GIL), plus setting an event when the buffer was
empty so the flusher wakes. Everything slow (JSON, the write) happens on the
flusher thread ``nbtools-events`` or in ``flush``.

Invariants:
- Memory is bounded: at most ``capacity`` records in the buffer plus one
  encoded batch in hand. When the buffer is full, ``put`` drops and counts.
- Every event is either delivered or counted as dropped, and each count travels
  in the header of the next delivered batch, so the kernel knows how many
  events each process lost.
- Only one thread sends at a time (``_send_lock``), so batches leave in order.
- The flusher sends at most ``rate`` events per second (with bursts up to the
  buffer's capacity). A process that emits faster, e.g. a tight loop, drops
  the excess: the flusher's JSON work would otherwise take the GIL from the
  training thread, and the kernel's reader would take it from the notebook.
  ``flush`` (the end of a rank, the exit) is not limited.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from nbtools._internal.log import get_logger
from nbtools.events._sinks import FULL, SENT, Sink
from nbtools.events._wire import BATCH_BYTES, BATCH_SUFFIX, Record, batch_prefix, encode_event

__all__ = ["Emitter", "THREAD_NAME"]

_log = get_logger("events")

THREAD_NAME = "nbtools-events"
# The flusher waits this long after the first event of a quiet spell, so that a
# burst leaves as a few full batches instead of many one-event writes.
_COALESCE_S = 0.01
# Longest sleep of an idle flusher; it also bounds a lost wake-up.
_IDLE_S = 1.0
# Retry period while the channel is full or the rate limit holds events back.
_RETRY_S = 0.02
# Widest header: the dropped count is stamped at send time and may grow meanwhile.
_MAX_DROPPED_DIGITS = 20


class Emitter:
    """Buffers this process's events and sends them through ``sink`` in batches.

    Args:
        sink: The channel's sending end.
        host: Host name stamped on every batch.
        pid: This process's id.
        rank: This process's own rank (None outside a run).
        capacity: Most events waiting in the buffer.
        rate: Most events per second the flusher sends, on average.
    """

    def __init__(
        self,
        sink: Sink,
        host: str,
        pid: int,
        rank: int | None,
        capacity: int = 10_000,
        rate: float = 10_000.0,
    ) -> None:
        self._sink = sink
        self._header = (host, pid, rank)
        self._capacity = capacity
        self._buffer: deque[Record] = deque()
        self._wake = threading.Event()
        self._send_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._start_lock = threading.Lock()  # never the send lock: a flush may hold that
        self._dropped = 0  # dropped and not yet reported; guarded by _count_lock
        self._pending: bytes | None = None  # an encoded batch the channel refused (FULL)
        self._pending_events = 0
        self._pending_dropped = 0
        self._carry: bytes | None = None  # an encoded event that did not fit the last batch
        self._rate = float(rate)
        self._tokens = float(capacity)  # events the flusher may send now
        self._refilled_at = time.monotonic()
        self._closing = False
        self._thread: threading.Thread | None = None
        # Called on the flusher thread before each send; each returns records to queue
        # (the coalesced step reports of :mod:`nbtools.events._progress`).
        self._sources: list[Callable[[], list[Record]]] = []
        room = BATCH_BYTES - len(batch_prefix(host, pid, rank, 10**_MAX_DROPPED_DIGITS))
        self._room = room - len(BATCH_SUFFIX)

    # --- caller side ---------------------------------------------------------

    def put(self, record: Record) -> None:
        """Queue one record; never blocks. Drops and counts it when the buffer is full."""
        buffer = self._buffer
        if len(buffer) >= self._capacity:
            self._drop(1)
            return
        buffer.append(record)
        if len(buffer) == 1:
            self._wake.set()
        if self._thread is None:
            self._start()

    def add_source(self, source: Callable[[], list[Record]]) -> None:
        """Poll ``source()`` on the flusher thread, at least once a second, for records to send."""
        self._sources.append(source)
        if self._thread is None:
            self._start()

    def _poll_sources(self) -> None:
        for source in self._sources:
            for record in source():
                self.put(record)

    def _drop(self, count: int) -> None:
        with self._count_lock:
            self._dropped += count

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None or self._closing:
                return
            thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            thread.start()
            self._thread = thread

    # --- flusher -------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            busy = self._pending is not None or bool(self._buffer)
            self._wake.wait(_RETRY_S if busy else _IDLE_S)
            self._wake.clear()
            if self._closing:
                break
            time.sleep(_COALESCE_S)
            try:
                self._poll_sources()
                self.send(deadline=None, limited=True)
            except Exception:  # noqa: BLE001 - the flusher must outlive a bad batch
                _log.exception("sending events failed; the flusher tries again")

    def send(self, deadline: float | None, limited: bool = False) -> bool:
        """Send everything buffered; True when nothing is left unsent.

        With ``deadline`` None a full channel ends the attempt at once (the
        flusher retries soon); otherwise it is retried until the monotonic
        ``deadline``. A channel nobody reads ends it at once. With ``limited``
        the rate limit applies.
        """
        with self._send_lock:
            while True:
                if self._pending is None:
                    if limited and not self._may_send():
                        return False
                    if not self._next_batch():
                        return True
                    if limited:
                        self._tokens -= self._pending_events
                outcome = self._sink.send(self._pending)  # type: ignore[arg-type]
                if outcome == SENT:
                    self._pending = None
                    continue
                if outcome == FULL:
                    if deadline is None or time.monotonic() >= deadline:
                        return False
                    time.sleep(0.002)
                    continue
                # Nobody reads the channel (the kernel stopped collecting): what is
                # queued is lost, and counted in case a reader comes back. Waiting
                # for one would only hold up this process's exit.
                lost = self._pending_events + self._pending_dropped + self._discard_buffer()
                if self._carry is not None:
                    self._carry = None
                    lost += 1
                self._drop(lost)
                self._pending = None
                return False

    def _may_send(self) -> bool:
        now = time.monotonic()
        self._tokens = min(
            float(self._capacity), self._tokens + (now - self._refilled_at) * self._rate
        )
        self._refilled_at = now
        return self._tokens >= 1.0

    def _discard_buffer(self) -> int:
        # popleft, not clear(): a record appended meanwhile is either counted or kept.
        count = 0
        buffer = self._buffer
        while buffer:
            buffer.popleft()
            count += 1
        return count

    def _next_batch(self) -> bool:
        """Encode the next batch into ``_pending``; False when there is nothing to send."""
        parts: list[bytes] = []
        size = 0
        buffer = self._buffer
        carry, self._carry = self._carry, None
        while True:
            if carry is not None:
                data, carry = carry, None
            elif buffer:
                data = encode_event(buffer.popleft())
            else:
                break
            if parts and size + len(data) + 1 > self._room:
                self._carry = data
                break
            parts.append(data)
            size += len(data) + 1
        with self._count_lock:
            dropped, self._dropped = self._dropped, 0
        if not parts and not dropped:
            return False
        host, pid, rank = self._header
        self._pending = batch_prefix(host, pid, rank, dropped) + b",".join(parts) + BATCH_SUFFIX
        self._pending_events = len(parts)
        self._pending_dropped = dropped
        return True

    # --- end of life -----------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Send everything queued so far, waiting up to ``timeout`` s for a full channel."""
        self._poll_sources()
        return self.send(deadline=time.monotonic() + timeout)

    def close(self, timeout: float = 2.0) -> bool:
        """Flush, then stop the flusher thread and release the sink."""
        delivered = self.flush(timeout)
        self._closing = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._sink.close()
        return delivered

    def abandon(self) -> None:
        """Forget everything without sending (in a forked child: the parent owns it)."""
        self._closing = True
        self._buffer.clear()
        self._sink.close()
