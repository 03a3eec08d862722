"""The eviction gate: one shared lock that stands in for per-file pins while nothing evicts.

Pinning a cached file costs an ``open``, an ``flock`` and an ``fstat``; on a
cache that is not short of space no eviction runs, so that cost buys nothing.
A stream may therefore hold the cache-wide gate (a shared ``flock`` on
``.locks/gate``) instead, and serve hits after a single ``stat``.

Protocol (every process on the node, through the cache directory):

* Eviction deletes files only while it holds the gate exclusively.
* Before trying, an evictor raises the *wanted* flag, a byte in a shared
  mapping of the gate file. Streams that hold the gate watch the flag (a
  memory read, from a watcher thread, so idle streams answer too), take
  per-file pins on every file they still protect, and let the gate go.
* A stream enters the gate only while the flag is down, and re-checks the flag
  after taking its shared lock; an evictor that gets the exclusive lock lowers
  the flag when done.

So a file a stream protects is covered, at every instant, by the gate or by its
own pin, and an eviction never waits on an idle stream for longer than the
watcher's poll interval. The watcher is one daemon thread per process, running
while some holder is watched (:func:`watch`, :func:`unwatch`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from typing import Protocol

__all__ = ["Gate", "GateHolder", "KnownFiles", "watch", "unwatch"]

_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_POLL_S = 0.01
# Bytes of the shared mapping: [0] the wanted flag, [8:16] evictions ended (a native uint64).
_GENERATION = slice(8, 16)


class Gate:
    """The gate of the cache whose lock directory is ``locks_dir``."""

    def __init__(self, locks_dir: str) -> None:
        self.path = os.path.join(locks_dir, "gate")
        fd = os.open(self.path, _FLAGS, 0o600)
        try:
            if os.fstat(fd).st_size < mmap.PAGESIZE:
                os.ftruncate(fd, mmap.PAGESIZE)  # idempotent: every opener asks the same size
            self._flag = mmap.mmap(fd, mmap.PAGESIZE)
            self._generation = memoryview(self._flag)[_GENERATION].cast("Q")  # native order
        finally:
            os.close(fd)  # the mapping keeps its own reference

    def wanted(self) -> bool:
        """True while some process waits to evict."""
        return self._flag[0] != 0

    def enter(self) -> int:
        """A descriptor that holds the gate shared, or -1 when an eviction is wanted or running."""
        if self.wanted():
            return -1
        fd = os.open(self.path, _FLAGS, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -1
        if self.wanted():  # raised between the first check and the lock: step aside
            os.close(fd)
            return -1
        return fd

    def close_for_eviction(self) -> int:
        """Ask gate holders to switch to pins; a descriptor holding the gate exclusively
        once none is left, else -1 (try again after they had time to answer)."""
        self._flag[0] = 1
        fd = os.open(self.path, _FLAGS, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -1
        return fd

    def generation(self) -> int:
        """How many evictions have ended on this cache, by any process."""
        return self._generation[0]

    def reopen(self, fd: int) -> None:
        """End an eviction started by :meth:`close_for_eviction`, counting it."""
        # Still exclusive here: no gate holder reads the counter while it changes.
        self._generation[0] = (self._generation[0] + 1) % (1 << 64)
        self._flag[0] = 0
        os.close(fd)


class KnownFiles:
    """Cached files this process saw complete since the last eviction: hits without a ``stat``.

    Only an eviction deletes a complete file, and every eviction moves the gate's
    generation, which empties the memo. An entry is added only while its file is
    pinned or the gate is held, and read only while the gate is held (no eviction
    can run then), so an entry never outlives its file.
    """

    #: Entries kept at most; past it the memo starts again (hits ``stat`` once more).
    MAX_ENTRIES = 1 << 20

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self._counter = gate._generation  # read per lookup: the shared counter itself
        self._entries: dict[str, tuple[int, int]] = {}
        self._generation = gate.generation()

    def _current(self) -> dict[str, tuple[int, int]]:
        generation = self._gate.generation()
        if generation != self._generation:
            self._entries = {}
            self._generation = generation
        return self._entries

    def has(self, key: str, size: int, mtime_ns: int) -> bool:
        """True when ``key`` was seen complete and up to date since the last eviction."""
        if self._counter[0] != self._generation:
            return False  # ``add`` starts the memo again
        return self._entries.get(key) == (size, mtime_ns)

    def entries(self) -> dict[str, tuple[int, int]] | None:
        """``key -> (size, mtime_ns)`` of the files seen complete, while current; else None.

        For a caller that holds the gate (no eviction can run meanwhile) and
        looks up many keys at once.
        """
        if self._counter[0] != self._generation:
            return None
        return self._entries

    def add(self, key: str, size: int, mtime_ns: int) -> None:
        """Remember that ``key`` is complete and up to date (its file pinned, or the gate held)."""
        entries = self._current()
        if len(entries) >= self.MAX_ENTRIES:
            entries.clear()
        entries[key] = (size, mtime_ns)


# --- the watcher --------------------------------------------------------------------------


class GateHolder(Protocol):
    """What holds a gate and is watched: a stream of ``_stream._stream``."""

    def leave_gate(self) -> None:
        """Pin every file the gate protects for this holder, then let the gate go."""


#: The holders being watched, each with the gate it holds.
_WATCHED: dict[GateHolder, Gate] = {}
_WATCH_LOCK = threading.Lock()
_WATCHER: list[threading.Thread] = []


def _watch_loop() -> None:
    while True:
        with _WATCH_LOCK:
            watched = list(_WATCHED.items())
            if not watched:
                _WATCHER.clear()
                return
        for holder, gate in watched:
            if gate.wanted():
                holder.leave_gate()
        time.sleep(_POLL_S)


def watch(holder: GateHolder, gate: Gate) -> None:
    """Call ``holder.leave_gate()`` as soon as an eviction of ``gate`` is wanted, until unwatched."""
    with _WATCH_LOCK:
        _WATCHED[holder] = gate
        if not _WATCHER:
            thread = threading.Thread(target=_watch_loop, name="nbtools-data-gate", daemon=True)
            _WATCHER.append(thread)
            thread.start()


def unwatch(holder: GateHolder) -> None:
    """Stop watching ``holder`` (idempotent); the watcher ends when none is left."""
    with _WATCH_LOCK:
        _WATCHED.pop(holder, None)


def _after_fork_in_child() -> None:
    global _WATCH_LOCK
    _WATCH_LOCK = threading.Lock()  # the parent's watcher may have held it
    _WATCHER.clear()
    _WATCHED.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
