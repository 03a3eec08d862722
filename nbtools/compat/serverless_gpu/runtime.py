"""``serverless_gpu.runtime``: the documented rank helpers, as :mod:`nbtools.runtime`."""

from __future__ import annotations

from typing import Any

from nbtools.runtime import get_local_rank, get_local_world_size, get_node_rank, get_world_size

__all__ = [
    "get_global_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_world_size",
]


def get_global_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the global rank, ``RANK``)."""
    if group is None:
        from nbtools.runtime import get_rank

        return get_rank()
    import torch.distributed as dist

    return dist.get_rank(group)
