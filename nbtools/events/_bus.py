"""The kernel's record of events: a bounded, time-bounded log with subscribers.

Events are kept for ``max_age_s`` (2 h, like the pane's samples) and at most
``max_events`` of them; the oldest go first. Every publisher (the collector's
reader thread, a local ``emit``) appends under one lock; subscribers are called
after the lock is released, on the publishing thread, so a callback must be
quick (set a flag, append to a list) and must not emit events itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.events import _ask
from nbtools.events._record import Event

__all__ = ["Bus", "Subscriber"]

_log = get_logger("events")

#: Called with the events just published (possibly none when only drops were reported).
Subscriber = Callable[[list[Event]], Any]


class Bus:
    """A thread-safe, bounded log of events with subscribers.

    Args:
        max_age_s: Events older than this (by their own time stamp) are forgotten.
        max_events: Most events kept; the oldest are forgotten first.
        clock: Source of the current time (``time.time``).

    Example:
        >>> bus = Bus(max_events=100)
        >>> seen = []
        >>> _ = bus.subscribe(seen.extend)
    """

    def __init__(
        self,
        max_age_s: float = 7200.0,
        max_events: int = 50_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s!r}")
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be a positive int, got {max_events!r}")
        self.max_age_s = float(max_age_s)
        self._clock = clock
        self._events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._subscribers: tuple[Subscriber, ...] = ()
        self._dropped: dict[tuple[str, int | None, int], int] = {}
        self._dropped_total = 0
        self._malformed = 0
        self._rejected = 0

    # --- publishing ----------------------------------------------------------

    def publish(
        self,
        events: list[Event],
        *,
        dropped: int = 0,
        source: tuple[str, int | None, int] | None = None,
    ) -> None:
        """Record ``events`` and the number of events ``source`` dropped before them.

        The ranks' answers to an ask (``collectives`` events) go to the ask that
        waits for them, not into the log; a rank's report at its start, before any
        step, goes to the subscribers (the hang watch) but not into the log either.
        """
        events = _ask.divert(events)
        with self._lock:
            self._events.extend(e for e in events if not _start_report(e))
            if dropped:
                key = source if source is not None else ("", None, 0)
                self._dropped[key] = self._dropped.get(key, 0) + dropped
                self._dropped_total += dropped
            self._prune()
            subscribers = self._subscribers
        if subscribers and (events or dropped):
            self._notify(subscribers, events)

    def publish_one(self, event: Event) -> None:
        """Record one event (the path of ``emit`` in a process without a channel)."""
        events = self._events
        with self._lock:
            events.append(event)
            if events[0].time < event.time - self.max_age_s:
                self._prune()
            subscribers = self._subscribers
        if subscribers:
            self._notify(subscribers, [event])

    def count_malformed(self) -> None:
        """Note a batch that could not be read (kept for diagnostics)."""
        with self._lock:
            self._malformed += 1

    def count_rejected(self, count: int = 1) -> None:
        """Note events that arrived in a readable batch but were not valid events (left out)."""
        with self._lock:
            self._rejected += count

    def _prune(self) -> None:
        horizon = self._clock() - self.max_age_s
        events = self._events
        while events and events[0].time < horizon:
            events.popleft()

    def _notify(self, subscribers: tuple[Subscriber, ...], events: list[Event]) -> None:
        for callback in subscribers:
            try:
                callback(events)
            except Exception:  # noqa: BLE001 - one broken viewer must not stop delivery
                _log.exception("an events subscriber raised; it stays subscribed")

    # --- subscribers ---------------------------------------------------------

    def subscribe(self, callback: Subscriber) -> Subscriber:
        """Call ``callback(events)`` with each published group of events; returns it."""
        if not callable(callback):
            raise TypeError(f"subscribe needs a callable, not {type(callback).__name__}")
        with self._lock:
            self._subscribers = (*self._subscribers, callback)
        return callback

    def unsubscribe(self, callback: Subscriber) -> None:
        """Stop calling ``callback``; a callback that is not subscribed is ignored."""
        with self._lock:
            # == and not "is": each "obj.method" access makes a new, equal bound method.
            self._subscribers = tuple(s for s in self._subscribers if s != callback)

    # --- reading -------------------------------------------------------------

    def log(
        self,
        since: float | None = None,
        kinds: Iterable[str] | None = None,
    ) -> list[Event]:
        """The events kept, oldest first by time stamp.

        Args:
            since: Only events stamped at or after this time (seconds since the epoch).
            kinds: Only events of these kinds.
        """
        wanted = None if kinds is None else ({kinds} if isinstance(kinds, str) else set(kinds))
        with self._lock:
            self._prune()
            rows = list(self._events)
        if since is not None:
            rows = [e for e in rows if e.time >= since]
        if wanted is not None:
            rows = [e for e in rows if e.kind in wanted]
        rows.sort(key=lambda e: e.time)
        return rows

    def dropped(self) -> int:
        """Events that processes reported as dropped before they reached this bus."""
        with self._lock:
            return self._dropped_total

    def dropped_by_source(self) -> dict[tuple[str, int | None, int], int]:
        """Dropped counts per emitting process, keyed by ``(host, rank, pid)``."""
        with self._lock:
            return dict(self._dropped)

    def malformed(self) -> int:
        """Batches that arrived but could not be read."""
        with self._lock:
            return self._malformed

    def rejected(self) -> int:
        """Events that arrived but failed the checks (e.g. a time that is not a number)."""
        with self._lock:
            return self._rejected

    def clear(self) -> None:
        """Forget every event and dropped count (subscribers stay)."""
        with self._lock:
            self._events.clear()
            self._dropped.clear()
            self._dropped_total = 0
            self._malformed = 0
            self._rejected = 0

    def _after_fork(self) -> None:
        # Another thread of the parent may have held the lock at the fork.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


def _start_report(event: Event) -> bool:
    """Whether ``event`` is a rank's progress report at its start: no step, no sign of life
    but the report itself (see ``events._progress.started``); or one that only carries what
    the rank's probe saw while nothing moved (``still``)."""
    fields = event.fields
    if event.kind == "progress" and fields.get("still") is True:
        return True
    return (
        event.kind == "progress"
        and event.step is None
        and fields.get("steps") == 0
        and "alive" not in fields
        and "phase" not in fields
    )
