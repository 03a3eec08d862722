"""A fork waits for the background saves in flight.

Forking copies only the forking thread. A lock that another thread holds at
that instant, inside the C library or torch (a background save writes, logs,
allocates), stays held in the child for good. DataLoader workers forked at the
start of an epoch, right after the asynchronous save of the previous one, can
then hang in their first allocation of shared memory. So before this process
forks, it waits for the saves it has in flight (at most ``FORK_WAIT_S``): a
loader that starts its workers once (``persistent_workers=True``, as nbtools'
``DataLoader`` does) never waits; one that starts them every epoch waits at
most for the end of one save.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from concurrent.futures import Future
from typing import Any

from nbtools._internal.log import get_logger

__all__ = ["FORK_WAIT_S", "track"]

#: Longest a fork waits for the saves in flight before it goes ahead anyway.
FORK_WAIT_S = 600.0

_log = get_logger("checkpoint")
# Plain set operations are atomic under the GIL: no lock that a fork could copy while held.
_IN_FLIGHT: set[Future[Any]] = set()


def track(future: Future[Any]) -> None:
    """Make forks of this process wait for ``future`` (a background save) while it runs."""
    _IN_FLIGHT.add(future)
    future.add_done_callback(_IN_FLIGHT.discard)


def _before_fork() -> None:
    running = [f for f in list(_IN_FLIGHT) if not f.done()]
    if not running:
        return
    started = time.monotonic()
    _, pending = concurrent.futures.wait(running, timeout=FORK_WAIT_S)
    waited = time.monotonic() - started
    if pending:
        _log.warning(
            "a fork waited %.0f s for a background checkpoint save that has not finished; "
            "forking anyway (the new process may hang if the save holds a lock)",
            waited,
        )
    elif waited > 1.0:
        _log.info("a fork waited %.1f s for a background checkpoint save to finish", waited)


os.register_at_fork(before=_before_fork)
