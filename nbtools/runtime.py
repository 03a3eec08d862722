"""Where am I? Rank and world information, inside and outside ``@distributed`` ranks.

Each function prefers an initialised ``torch.distributed`` default group (when
torch is already imported) and falls back to the environment variables that
``@distributed`` and torchrun set. Outside any run they return rank 0 of a world
of 1. This module never imports torch itself.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "get_rank",
    "get_local_rank",
    "get_world_size",
    "get_local_world_size",
    "get_node_rank",
    "get_restart_count",
    "is_main_process",
    "is_distributed",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; unset it or fix it"
        ) from None


def _dist():
    """The ``torch.distributed`` module when torch is loaded and a group is up, else None."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def is_distributed() -> bool:
    """True when a ``torch.distributed`` default process group is initialised."""
    return _dist() is not None


def get_rank() -> int:
    """Global rank of this process (0 outside a distributed run)."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the run (1 outside a distributed run)."""
    dist = _dist()
    if dist is not None:
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """Rank of this process on its node (0 outside a distributed run)."""
    return _env_int("LOCAL_RANK", 0)


def get_local_world_size() -> int:
    """Number of ranks on this node (1 outside a distributed run)."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node among the run's nodes (0 on a single node)."""
    if "GROUP_RANK" in os.environ:
        return _env_int("GROUP_RANK", 0)
    return _env_int("NODE_RANK", 0)


def get_restart_count() -> int:
    """How many times the group has been restarted after a failure (0 on the first try)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def is_main_process() -> bool:
    """True on global rank 0, and in a plain process outside any run."""
    return get_rank() == 0
