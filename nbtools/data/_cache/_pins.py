"""Pins: shared ``flock`` locks that keep a cached file from being evicted while in use."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

__all__ = ["Cancelled", "Pin", "pin_path", "still_linked"]


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
