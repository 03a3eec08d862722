"""A lease: a file that says one process does a job, kept fresh while it does.

Two rooms hold one: the checkpoint writer's lease on a root (one run saves there) and the
dataset listing's lease beside a shared index (one node lists a root while the others wait).
They keep their files differently (a checkpoint root may be an object store; the listing's
lease is a local file created with ``O_EXCL``), and this module is what they share:

- :func:`lease_record`: what a lease (or a save marker) says of its holder: host, process id,
  start time and machine (see :class:`~nbtools._internal.holder.Holder`), then its own fields;
- :class:`Heartbeat`: the thread that renews a held lease every few seconds until stopped;
- :class:`LeaseWatch`: the verdict on another process's lease (:class:`Verdict`), from
  whether its holder lives (on this machine), how old the lease says it is, and whether it
  changes while watched on this process's own clock (a holder on another machine).

A lease is gone when its holder on this machine is dead (a reused process id counts as dead),
when it is older than ``max_age_s`` by its own timestamp, or when it has not changed for
``quiet_s`` while watched; it is live when a change was seen within ``quiet_s``, and pending
until then. Watching for a change, rather than comparing timestamps, does not depend on two
machines' clocks agreeing.

Example:
    >>> from nbtools._internal.lease import LeaseWatch, Verdict, lease_record
    >>> record = lease_record(job="j1", since=0.0)  # this process, a lease of long ago
    >>> LeaseWatch(quiet_s=30.0, max_age_s=600.0).judge(record, key="j1", mark=1, written_at=0.0)
    <Verdict.GONE: 'gone'>
"""

from __future__ import annotations

import enum
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.holder import Holder, Liveness, machine_id

__all__ = ["Heartbeat", "LeaseWatch", "Verdict", "lease_holder", "lease_record"]


def lease_record(**fields: Any) -> dict[str, Any]:
    """What a lease or marker file records of this process, followed by ``fields``.

    The keys ``host``, ``pid``, ``started`` and ``machine`` are what
    :func:`lease_holder` reads back.
    """
    return {"host": socket.gethostname(), **Holder.me().record(), **fields}


def lease_holder(record: Any) -> Holder | None:
    """The process a lease names; None when it names none.

    A record without a machine (written by an older version: host and process id only)
    names a process of this machine when its host is this one, without a start time.
    """
    holder = Holder.from_record(record)
    if holder is not None or not isinstance(record, dict):
        return holder
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    return Holder(machine_id(), pid, None)


class Heartbeat:
    """Calls ``beat`` every ``interval`` seconds on a daemon thread until :meth:`stop`.

    ``beat`` returning False ends the thread (the lease was lost). Started once.

    Args:
        beat: What renews the lease.
        interval: Seconds between two beats (the first one comes after one interval).
        name: The thread's name.
    """

    def __init__(self, beat: Callable[[], bool | None], interval: float, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeat:
        """Start beating; returns the heartbeat."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if self._beat() is False:
                return

    def stop(self, wait: bool = True) -> None:
        """No more beats; with ``wait``, until a beat in progress ends (idempotent, and a beat
        may call it)."""
        self._stopped.set()
        if (
            wait
            and self._thread.ident is not None
            and self._thread is not threading.current_thread()
        ):
            self._thread.join()


class Verdict(enum.Enum):
    """What :meth:`LeaseWatch.judge` found of another process's lease."""

    #: Its holder is alive, or the lease changed recently: it is held.
    LIVE = "live"
    #: Its holder is dead, or the lease is too old or stopped changing: take it over.
    GONE = "gone"
    #: Watched, and no change seen yet: ask again later.
    PENDING = "pending"


class LeaseWatch:
    """The verdict on another process's lease, from what is seen of it over time.

    Args:
        quiet_s: A watched lease unchanged this long (this process's clock) is gone; one
            that changed within it is live.
        max_age_s: A lease older than this by its own timestamp is gone at once.
        fresh_local_s: For a lease whose holder runs on this machine: live at once when the
            holder runs and the lease's timestamp is this recent (same clock), else gone; a
            lease without a start time is then no evidence of anything (gone). None: a holder
            of this machine that runs is watched like any other.
        mine_is_gone: A lease of this very process was left by an earlier object of it,
            which the caller supersedes.
    """

    def __init__(
        self,
        *,
        quiet_s: float,
        max_age_s: float,
        fresh_local_s: float | None = None,
        mine_is_gone: bool = False,
    ) -> None:
        self.quiet_s = quiet_s
        self.max_age_s = max_age_s
        self.fresh_local_s = fresh_local_s
        self.mine_is_gone = mine_is_gone
        self.forget()

    def judge(self, record: Any, *, key: Any, mark: Any, written_at: float | None) -> Verdict:
        """The verdict on the lease ``record`` now.

        Args:
            record: What the lease file holds (its holder, see :func:`lease_holder`).
            key: Who holds it (a token, or the holder's identity): a new key is a new lease,
                watched afresh.
            mark: What changes when its holder renews it (its content, or its mtime).
            written_at: When it was last written, by its own clock; None when it does not say.
        """
        holder = lease_holder(record)
        if holder is not None and holder.here:
            if holder.pid == os.getpid():
                if self.mine_is_gone:
                    return Verdict.GONE
            elif self.fresh_local_s is not None:
                fresh = written_at is not None and time.time() - written_at <= self.fresh_local_s
                if not fresh or holder.started is None:
                    return Verdict.GONE
                return Verdict.LIVE if holder.alive() is Liveness.ALIVE else Verdict.GONE
            elif holder.alive() is Liveness.DEAD:
                return Verdict.GONE
        if written_at is None or time.time() - written_at > self.max_age_s:
            return Verdict.GONE
        return self._watch(key, mark)

    def forget(self) -> None:
        """Watch no lease (the next one judged is watched afresh)."""
        self._watching = False
        self._key: Any = None
        self._mark: Any = None
        self._seen_at = 0.0
        self._changed_at: float | None = None

    @property
    def watched(self) -> Any:
        """The mark of the lease being watched (as last seen); None when none is."""
        return self._mark if self._watching else None

    def _watch(self, key: Any, mark: Any) -> Verdict:
        now = time.monotonic()
        if not self._watching or key != self._key:
            self._watching = True
            self._key, self._mark, self._seen_at, self._changed_at = key, mark, now, None
        elif mark != self._mark:
            self._mark, self._changed_at = mark, now
        if self._changed_at is not None and now - self._changed_at < self.quiet_s:
            return Verdict.LIVE
        if now - self.quiet_since >= self.quiet_s:
            return Verdict.GONE
        return Verdict.PENDING

    @property
    def quiet_since(self) -> float:
        """Since when (``time.monotonic()``) the watched lease has not changed."""
        return max(self._seen_at, self._changed_at or 0.0)
