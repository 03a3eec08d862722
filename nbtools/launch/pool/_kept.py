"""``@distributed(..., keep_alive=True)``: one pool per configuration, reused by every call.

A kept pool is an ordinary :class:`~nbtools.launch.RankPool`, created by the
first call with its options and closed by ``distributed.shutdown()`` or at
exit. Calls keep ``@distributed``'s meaning of ``max_restarts``: after a
failure the call is run again, up to that many times; ranks that died are
replaced by the pool itself whenever that happens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError
from nbtools.launch._config import LaunchConfig
from nbtools.launch.pool._pool import RankPool

__all__ = ["call_kept"]

_log = get_logger("launch")
_KEPT: dict[tuple, RankPool] = {}
_KEPT_LOCK = threading.Lock()


def call_kept(fn: Callable[..., Any], config: LaunchConfig, args: tuple, kwargs: dict) -> list[Any]:
    """Run ``fn`` on the kept pool of ``config``; run it again after a failure, up to
    ``config.max_restarts`` times."""
    __tracebackhide__ = True
    pool = _pool_for(config)
    attempt = 0
    while True:
        try:
            return pool.run(fn, *args, **kwargs)
        except DistributedError as exc:
            if attempt >= config.max_restarts:
                raise
            attempt += 1
            headline = str(exc).splitlines()[0]
            events.emit("restart", headline, attempt=attempt, max_restarts=config.max_restarts)
            _log.warning(
                "%s; running the call again (restart %d of %d)",
                headline,
                attempt,
                config.max_restarts,
            )


def _pool_for(config: LaunchConfig) -> RankPool:
    with _KEPT_LOCK:
        pool = _KEPT.get(config.pool_key)
        if pool is None or pool.closed:
            # The ranks of a kept pool are replaced whenever they die: no limit.
            pool = RankPool.from_config(config, max_restarts=None)
            _KEPT[config.pool_key] = pool
        return pool
