"""The collectives the manager needs to keep its ranks on the same branch.

Both are no-ops without a process group (a notebook, a plain script).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["agree", "gather", "final_step"]


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


def final_step(pg: Any, seen: int | None, saved: int | None) -> tuple[int | None, list[Any]]:
    """The step every rank saves on close, or None; and what each rank proposed.

    A rank proposes the last step it gave ``maybe_save`` when that is newer than
    the last checkpoint. The ranks save only when they all propose the same step.
    """
    step = seen if seen is not None and (saved is None or seen > saved) else None
    steps = gather(pg, step)
    return (step if len(set(steps)) == 1 else None), steps
