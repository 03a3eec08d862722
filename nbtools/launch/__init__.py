"""Launching a notebook function on N ranks: ``@distributed``.

Example:
    >>> from nbtools.launch import distributed
    >>> @distributed(processes=2)
    ... def rank():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> rank.distributed()  # doctest: +SKIP
    [0, 1]

The names load on first use: a rank, and the forkserver that ranks start from,
import this package's rooms (``_rank``, ``_local``) without the kernel-side call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbtools.launch._api import DistributedFunction, distributed, warm_up
    from nbtools.launch._failures import RankFailure
    from nbtools.launch.pool import RankPool

__all__ = ["distributed", "DistributedFunction", "RankFailure", "RankPool", "warm_up"]

_WHERE = {
    "distributed": "nbtools.launch._api",
    "DistributedFunction": "nbtools.launch._api",
    "warm_up": "nbtools.launch._api",
    "RankFailure": "nbtools.launch._failures",
    "RankPool": "nbtools.launch.pool",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
