"""The collectives the manager needs to keep its ranks on the same branch.

Both are no-ops without a process group (a notebook, a plain script).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from nbtools._internal.log import get_logger

__all__ = ["agree", "gather", "final_step", "release_groups"]

_log = get_logger("checkpoint")
#: How long a closing manager waits for its peers before it keeps its groups instead.
CLOSE_TIMEOUT = datetime.timedelta(seconds=60)


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


def release_groups(groups: Sequence[Any], sync: Any = None) -> bool:
    """Destroy the process ``groups`` a manager made (their sockets, threads and
    descriptors go with them); whether they were destroyed.

    With ``sync`` (one of them, or another group of the same ranks), every rank first
    waits there for the others (a barrier of at most :data:`CLOSE_TIMEOUT`), so that no
    peer can still be in a collective on a group being destroyed; when a peer does not
    come, the groups are kept (a leak rather than a peer's collective broken).
    """
    groups = [g for g in groups if g is not None]
    if not groups or not dist.is_initialized():
        return False
    if sync is not None:
        try:
            dist.monitored_barrier(group=sync, timeout=CLOSE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a peer that did not close in time
            _log.info("keeping the checkpoint manager's process groups: %s", exc)
            return False
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # destroyed already (with the default group)
            pass
    return True
