"""Which pools this process holds, and one call at a time on each.

``distributed.shutdown()`` and interpreter exit close every pool listed here.
A pool belongs to the process that created it: a forked child (the kernel's,
or a library's worker) starts with no pools, so its exit hooks, its shutdown
and a ``close()`` there leave the parent's ranks and files alone, and a call
there is refused (it would share the parent's channel).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.errors import PoolError

__all__ = ["CallGuard", "owned", "register", "unregister", "shutdown", "open_pools"]

_log = get_logger("launch")
_OPEN: set[Any] = set()
_OPEN_LOCK = threading.Lock()


def register(pool: Any) -> None:
    """List an open pool (closed by :func:`shutdown`, in this process only)."""
    with _OPEN_LOCK:
        _OPEN.add(pool)


def owned(pool: Any) -> bool:
    """Whether ``pool`` was created by this process (not inherited through a fork)."""
    return getattr(pool, "owner_pid", os.getpid()) == os.getpid()


def _forget_in_child() -> None:
    """After a fork, in the child: the parent's pools are not this process's to close."""
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # another thread of the parent may have held it
    _OPEN.clear()


def unregister(pool: Any) -> None:
    """Forget a pool that has closed."""
    with _OPEN_LOCK:
        _OPEN.discard(pool)


class CallGuard:
    """One call at a time, on a pool that is open (and not stopped, unless restarting)."""

    def __init__(self, pool: Any, restartable: bool) -> None:
        self.pool = pool
        self.restartable = restartable

    def __enter__(self) -> None:
        pool = self.pool
        if not owned(pool):
            raise PoolError(
                f"this RankPool belongs to process {pool.owner_pid}; this process was forked from it "
                "and cannot use its ranks. Create a RankPool here if it needs ranks of its own"
            )
        if pool.closed:
            raise PoolError("this RankPool is closed; create a new one (or %distributed start)")
        if not pool.call_lock.acquire(blocking=False):
            raise PoolError("this RankPool is busy with a call from another thread; one at a time")
        if pool.closed or (pool.stopped_reason and not self.restartable):
            pool.call_lock.release()
            raise PoolError(
                f"{pool.stopped_reason or 'this RankPool is closed'}; call pool.restart() "
                "(%distributed restart) to start fresh ranks"
            )

    def __exit__(self, *exc: object) -> None:
        self.pool.call_lock.release()


def shutdown() -> None:
    """Close every pool this process holds (``distributed.shutdown()``; also at exit)."""
    with _OPEN_LOCK:
        pools = list(_OPEN)
    for pool in pools:
        if not owned(pool):
            continue
        try:
            pool.close()
        except Exception as exc:  # noqa: BLE001 - close every pool, report each failure
            _log.warning("closing %r failed: %s", pool, exc)


def open_pools() -> list[Any]:
    """The pools of this process that are not closed."""
    with _OPEN_LOCK:
        return list(_OPEN)


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget_in_child)
