"""``@distributed(..., keep_alive=True)``: one pool per configuration, reused by every call.

A kept pool is an ordinary :class:`~nbtools.launch.RankPool`, created by the
first call with its options and closed by ``distributed.shutdown()`` or at
exit. Calls keep ``@distributed``'s meaning of ``max_restarts``: after a
failure the call is run again, up to that many times; ranks that died are
replaced by the pool itself whenever that happens.
"""

from __future__ import annotations

import threading
from typing import Any

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError
from nbtools.launch._pool import RankPool

__all__ = ["call_kept"]

_log = get_logger("launch")
_KEPT: dict[tuple, RankPool] = {}
_KEPT_LOCK = threading.Lock()


def call_kept(function: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Run a ``DistributedFunction`` on the kept pool of its configuration."""
    pool = _pool_for(function)
    attempt = 0
    while True:
        try:
            return pool.run(function._fn, *args, **kwargs)
        except DistributedError as exc:
            if attempt >= function.max_restarts:
                raise
            attempt += 1
            headline = str(exc).splitlines()[0]
            events.emit("restart", headline, attempt=attempt, max_restarts=function.max_restarts)
            _log.warning(
                "%s; running the call again (restart %d of %d)",
                headline, attempt, function.max_restarts,
            )


def _pool_for(function: Any) -> RankPool:
    key = (
        function.gpus, function.processes, function.cluster, function.nodes,
        repr(function.runtime_env), function.output, function.hang_timeout,
    )
    with _KEPT_LOCK:
        pool = _KEPT.get(key)
        if pool is None or pool.closed:
            pool = RankPool(
                processes=function.processes, gpus=function.gpus, max_restarts=None,
                output=function.output, hang_timeout=function.hang_timeout,
                cluster=function.cluster, nodes=function.nodes, runtime_env=function.runtime_env,
            )
            _KEPT[key] = pool
        return pool
