"""The two collectives the manager needs to keep its ranks on the same branch.

Both are no-ops without a process group (a notebook, a plain script).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["agree", "gather"]


def agree(pg: Any, value: Any) -> Any:
    """Rank 0's ``value`` on every rank of ``pg`` (ranks must take the same branch)."""
    if pg is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]


def gather(pg: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    if pg is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, value, group=pg)
    return out
