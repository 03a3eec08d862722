"""The data layer's own process group, so that its collectives never meet anyone else's.

Planning an iteration (``iter(loader)``) and ``state_dict()`` agree across ranks
with object collectives. On the default group they would interleave with
collectives other threads issue on that group at the same moment, above all
``dcp.async_save``, whose whole save (plan, write, metadata) runs in a
background thread on the default group. Gloo matches collectives by their order
on a group, so a rank whose main thread gathered the data plan while its save
thread broadcast the save plan, and a rank that did both in the other order,
wait for each other forever.

:func:`data_group` therefore creates one gloo group over all ranks, once per
default group (``dist.new_group`` synchronizes through the store, not through a
collective, so creating it while a save is in flight is safe). Every rank
reaches its first data collective at the same point of its program, so every
rank creates the group in the same order. ``dist.destroy_process_group()``
destroys it with the default group; a later ``init_process_group`` gets a new one.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["data_group"]

_LOCK = threading.Lock()
_groups: tuple[Any, Any] | None = None  # (the default group it belongs to, the data group)


def data_group(dist: Any) -> Any:
    """The data layer's gloo group over every rank of the (initialised) default group."""
    global _groups
    default = dist.group.WORLD
    with _LOCK:
        if _groups is None or _groups[0] is not default:
            _groups = (default, dist.new_group(backend="gloo"))
        return _groups[1]
