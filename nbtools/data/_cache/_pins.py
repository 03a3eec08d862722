"""Pins and guards: what keeps a cached file from being evicted while it is in use.

A pin is a shared ``flock`` on one cached file. A stream's guard says how a complete cached
file it serves is kept: a file ahead of the consumer or handed out is protected either by a pin
of its own or by the cache's gate while no eviction is wanted (``_gate``); under the gate, a
handed-out file's guard may be its bare path.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "Cancelled",
    "Guard",
    "Pin",
    "State",
    "drop",
    "pin_path",
    "settled",
    "still_linked",
    "to_pin",
]


class Cancelled(Exception):
    """A copy was abandoned because its consumer went away."""


class Pin:
    """A shared lock on a cached file: while it is held the file is not evicted."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Let the file be evicted again (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the descriptor drops its flock

    def forget(self) -> None:
        """Drop the descriptor number without closing it (a forked child's copy)."""
        self._fd = -1


def still_linked(fd: int) -> os.stat_result | None:
    """``fstat(fd)`` unless the file was unlinked (evicted or replaced) meanwhile.

    Cache files are never renamed or hard-linked once in place, so a file that
    still has a link is still the one under its path.
    """
    st = os.fstat(fd)
    return st if st.st_nlink > 0 else None


def pin_path(path: str, accept: Callable[[os.stat_result], bool] | None = None) -> Pin | None:
    """A pin on whatever complete file is at ``path`` now, or None when there is none.

    ``accept`` may refuse the file by its status (an out-of-date copy): no pin then.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        st = still_linked(fd)
        if st is not None and (accept is None or accept(st)):
            return Pin(path, fd)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


@dataclass(frozen=True, slots=True)
class Guard:
    """How a complete cached file of a stream is kept from eviction.

    ``pin`` is the file's own pin, or None while the cache's gate protects it
    (nothing evicts then). A file that is not protected at all (a copy ahead
    that gave up) has no guard: the consumer fetches it itself.
    """

    path: str
    pin: Pin | None = None

    @classmethod
    def pinned(cls, pin: Pin) -> Guard:
        """The guard of a pinned file."""
        return cls(pin.path, pin)

    def release(self) -> None:
        """Let the file be evicted again, as far as this guard goes (idempotent)."""
        if self.pin is not None:
            self.pin.release()

    def to_pin(self) -> Guard | None:
        """This guard with a pin of its own (None when the file is gone meanwhile)."""
        if self.pin is not None:
            return self
        pin = pin_path(self.path)
        return None if pin is None else Guard(self.path, pin)


#: A file ahead of the consumer: its copy in flight, its guard, or None (not protected).
State = Optional[Future[Pin | None] | Guard]


def drop(guard: Guard | str | None) -> None:
    """Release ``guard`` (nothing for a bare path under the gate, or None)."""
    if isinstance(guard, Guard):
        guard.release()


def to_pin(guard: Guard | str) -> Guard | None:
    """``guard`` with a pin of its own (None when the file is gone meanwhile)."""
    if isinstance(guard, Guard):
        return guard.to_pin()
    pin = pin_path(guard)
    return None if pin is None else Guard(guard, pin)


def _as_guard(pin: Pin | None) -> Guard | None:
    return None if pin is None else Guard(pin.path, pin)


def settled(state: State) -> Guard | None:
    """The guard of a finished copy (None for one that failed, was cancelled or runs on)."""
    if not isinstance(state, Future):
        return state
    if state.done() and not state.cancelled() and state.exception() is None:
        return _as_guard(state.result())
    return None
