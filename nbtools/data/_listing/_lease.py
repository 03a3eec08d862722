"""Which node lists a dataset root when several start at once: a lease beside the shared index.

With ``index_in_root=True``, a node that finds no usable index anywhere takes
the *listing lease* before it lists: ``<root>/.nbtools-index/index-<tag>.idx.listing``,
created with ``O_EXCL`` and holding who took it (host, pid, job, when). While
the listing runs, a thread rewrites the lease every :data:`HEARTBEAT_S` with
how far the listing got (a new mtime each time); it is removed once the index
is published, or the listing failed. A node that finds the lease taken lists
nothing: it waits, polling the shared index, says on its rank 0 how far the
other node's listing got, and uses the index that node publishes. So 8 nodes
of one job starting at the same moment list a 10-million-file root once, not
8 times.

A lease whose mtime stops changing for :data:`STALE_S` (measured on the
waiter's own clock, so clock skew between nodes does not matter), or that
names a dead process on this host, or is older than :data:`ABANDONED_S` by
the clocks' own reckoning, belongs to a node that died: it is taken over,
with a log line. The lease only saves listings; nothing is ever read from
it but who holds it, and a lease that is not a plain file of this user's
(planted by someone else, a link, writable by others) is not waited on: the
node lists without one, with a warning. The verdict on a lease is
:class:`nbtools._internal.lease.LeaseWatch`'s, as for the checkpoint writer's lease, with the
timings here and the lease file's mtime as what changes. Where it cannot work (a mount
without ``O_EXCL``, two nodes taking over one stale lease at the same
moment) two nodes both list,
and each publishes a complete index, as without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from nbtools import runtime
from nbtools._internal.fs import TMP_PREFIX
from nbtools._internal.holder import Liveness
from nbtools._internal.lease import Heartbeat, LeaseWatch, Verdict, lease_holder, lease_record
from nbtools._internal.log import get_logger

__all__ = ["ABANDONED_S", "HEARTBEAT_S", "STALE_S", "ListingLease", "lead_or_wait"]

_log = get_logger("data.catalog")

#: How often the listing node refreshes its lease.
HEARTBEAT_S = 2.0
#: A lease not refreshed for this long (on the waiter's clock) is taken over.
STALE_S = 30.0
#: A lease whose mtime is this much older than the waiter's clock is taken over at once.
ABANDONED_S = 600.0
#: How often a waiting node says whom it waits for.
_SAY_EVERY_S = 30.0

T = TypeVar("T")


def _loud() -> bool:
    return runtime.get_rank() == 0


class ListingLease:
    """The listing lease of the index at ``shared`` (see the module docstring)."""

    def __init__(self, shared: str, job: str, progress: _Counts | None = None) -> None:
        self.path = shared + ".listing"
        # host/pid/job/since are what every version reads; machine and started (the
        # holder's pid namespace and start time) tell a reused pid apart.
        self.record = lease_record(job=job, since=time.time())
        self._progress = progress
        self._beat: Heartbeat | None = None
        #: Whether a dead node's lease was removed: it may have left temporaries behind.
        self.took_over = False

    def take(self) -> bool:
        """Take the lease; False when another node holds it.

        True also where no lease can be made (the directory refuses it): the
        caller then lists, as it would without one.
        """
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            why = self._foreign()
            if why is None:
                return False
            _log.warning(
                "not waiting on the listing lease %s: %s; listing without one", self.path, why
            )
            return True
        except OSError as exc:
            _log.info("no listing lease at %s (%s): listing without one", self.path, exc)
            return True
        try:
            os.write(fd, json.dumps(self.record).encode())
        finally:
            os.close(fd)
        self._beat = Heartbeat(self._renew, HEARTBEAT_S, "nbtools-index-lease").start()
        return True

    def _foreign(self) -> str | None:
        """Why the lease there is not one to wait on (not a plain file of this user's
        that only they can write: planted, or a link); None when it is."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return None  # just released: look again
        except OSError as exc:
            return str(exc)
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        if st.st_uid != os.getuid():
            return f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})"
        return None

    @property
    def held(self) -> bool:
        """Whether this node holds a real lease (False where none could be made)."""
        return self._beat is not None

    def _renew(self) -> bool:
        """One heartbeat: rewrite the lease with the listing's progress; False once it is
        another node's."""
        current = self.holder_id()
        if current is None:
            return True  # being taken over (moved aside): not to be made again
        if current != _identity(self.record):
            return False  # taken over: it is another node's now
        state = dict(self.record)
        if self._progress is not None:
            state.update(files=self._progress.files, dirs=self._progress.dirs)
        tmp = f"{os.path.dirname(self.path)}/{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(state, fh)
            os.replace(tmp, self.path)  # readers see the old state or the new one
        except OSError:
            with contextlib.suppress(OSError):
                os.utime(self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def release(self) -> None:
        """Stop refreshing the lease and remove it if it is still this one."""
        if self._beat is None:
            return
        self._beat.stop()
        self._beat = None
        if self.holder_id() == _identity(self.record):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def holder(self) -> dict[str, Any] | None:
        """What the lease says of its holder; None when there is no lease (or it is unreadable)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags)  # never follows a link, never blocks on a FIFO
            with open(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    return None
                value = json.loads(fh.read(4096) or b"null")
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def holder_id(self) -> tuple[Any, ...] | None:
        """Who holds the lease (host, pid, job, since), without its progress."""
        record = self.holder()
        return None if record is None else _identity(record)

    def mtime_ns(self) -> int | None:
        try:
            return os.lstat(self.path).st_mtime_ns
        except OSError:
            return None

    def judge(self, watch: LeaseWatch, root: str) -> bool:
        """One look at the lease another node holds, with the ``watch`` that keeps what earlier
        looks saw: remove it when its holder is gone (its process died on this machine, it
        stopped refreshing the lease for :data:`STALE_S`, or it is older than
        :data:`ABANDONED_S`). Returns whether it was removed, so that :meth:`take` can take it.
        """
        mtime = self.mtime_ns()
        if mtime is None:
            return False
        record = self.holder()
        if watch.judge(record, key=None, mark=mtime, written_at=mtime / 1e9) is not Verdict.GONE:
            return False
        who, age = _who(record), time.time() - mtime / 1e9
        if _dead(record):
            self.break_stale(f"{who} listed {root} and died")
        elif age > ABANDONED_S:
            self.break_stale(f"{who} left its lease {age:.0f} s ago")
        else:
            self.break_stale(f"{who} stopped refreshing its lease {STALE_S:.0f} s ago")
        watch.forget()
        return True

    def break_stale(self, why: str) -> None:
        """Remove a lease whose holder died (moved aside first, then removed)."""
        aside = f"{os.path.dirname(self.path)}/{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.rename(self.path, aside)
        except OSError:
            return  # gone already, or another node took it over first
        self.took_over = True
        _log.warning("taking over the listing of the dataset index: %s", why)
        with contextlib.suppress(OSError):
            os.unlink(aside)


class _Counts(Protocol):
    """How far a listing got (``_listing.Progress``)."""

    files: int
    dirs: int


def _who(record: dict[str, Any] | None) -> str:
    return f"{record.get('host')} (pid {record.get('pid')})" if record else "another node"


def _identity(record: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(record.get(k) for k in ("host", "pid", "job", "since"))


def _dead(record: dict[str, Any] | None) -> bool:
    """Whether the lease names a process of this machine that is gone (a reused pid is gone)."""
    holder = lease_holder(record)
    if holder is None or not holder.here:
        return False
    return holder.pid != os.getpid() and holder.alive() is Liveness.DEAD


def lead_or_wait(
    shared: str,
    job: str,
    root: str,
    look: Callable[[], T | None],
    progress: _Counts | None = None,
    poll_s: float = 0.25,
) -> tuple[ListingLease | None, T | None]:
    """Take the listing lease, or wait for the node that holds it to publish the index.

    ``look`` returns the index published in the root when it is usable, else
    None. ``progress``: how far this node's listing got, once it lists (shown
    to the nodes that wait). Returns ``(lease, None)`` when this node is to
    list (release the lease afterwards), or ``(None, index)`` with the index
    another node listed.
    """
    lease = ListingLease(shared, job, progress)
    watch = LeaseWatch(quiet_s=STALE_S, max_age_s=ABANDONED_S)
    said = time.monotonic()
    while True:
        if lease.take():
            found = look()  # the node that held it may have published just before
            if found is None:
                return lease, None
            lease.release()
            return None, found
        found = look()
        if found is not None:
            return None, found
        if lease.mtime_ns() is None:
            continue  # released: take it, or find the index it left
        if lease.judge(watch, root):
            continue  # its holder is gone: take it now
        now = time.monotonic()
        if now - said >= _SAY_EVERY_S:
            said = now
            record = lease.holder()
            if _loud():
                got = ""
                if record and isinstance(record.get("files"), int):
                    got = f": {record['files']} files in {record.get('dirs')} directories so far"
                _log.info(
                    "waiting for %s, which lists %s for every node%s", _who(record), root, got
                )
        time.sleep(poll_s)
