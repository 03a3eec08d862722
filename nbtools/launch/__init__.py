"""Launching a notebook function on N ranks: ``@distributed``.

Example:
    >>> from nbtools.launch import distributed
    >>> @distributed(processes=2)
    ... def rank():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> rank.distributed()  # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

from nbtools.launch._api import DistributedFunction, distributed, warm_up
from nbtools.launch._failures import RankFailure
from nbtools.launch.pool import RankPool

__all__ = ["distributed", "DistributedFunction", "RankFailure", "RankPool", "warm_up"]
