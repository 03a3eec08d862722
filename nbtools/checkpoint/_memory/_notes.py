"""What the memory tier says: one message per condition per job, never one per snapshot.

A damaged slot is listed at every snapshot, a full filesystem refuses every
replica, and a job lives on through restarts and through the managers a
notebook makes call after call: the tier says each condition once per
process. The record of what was said is bounded (a long-lived process
forgets the oldest conditions first).

Ranks other than 0 are quiet (the ``nbtools`` logger is rank-zero), except
for a condition of their rank alone (a replica it could not keep, a snapshot
it could not write): those are logged on that rank too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from nbtools._internal.log import get_logger

__all__ = ["once", "forget"]

_log = get_logger("checkpoint")
#: Conditions remembered at most (the oldest are forgotten first).
_LIMIT = 1024
_said: OrderedDict[str, None] = OrderedDict()


def once(
    condition: str, message: str, *args: object, level: int = logging.WARNING, mine: bool = False
) -> bool:
    """Log ``message % args`` unless ``condition`` was said already; whether it was logged.

    Args:
        condition: What the message is about, with the job's key in it (a job's
            condition, not a snapshot's: no step number).
        mine: The condition is this rank's alone: logged on any rank.
    """
    if condition in _said:
        return False
    _said[condition] = None
    while len(_said) > _LIMIT:
        _said.popitem(last=False)
    _log.log(level, message, *args, extra={"any_rank": True} if mine else None)
    return True


def forget(prefix: str) -> None:
    """Forget the conditions that start with ``prefix`` (a job that ended)."""
    for key in [k for k in _said if k.startswith(prefix)]:
        del _said[key]
