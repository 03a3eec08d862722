"""Where am I? Rank and world information, inside and outside ``@distributed`` ranks.

Each function prefers an initialised ``torch.distributed`` default group (when
torch is already imported) and falls back to the environment variables that
``@distributed`` and torchrun set. Outside any run they return rank 0 of a world
of 1. This module never imports torch itself.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = [
    "BatchPlan",
    "batch_plan",
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


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split over the ranks of a world (see :func:`batch_plan`).

    Attributes:
        global_batch_size: Samples of one optimizer step, all ranks together.
        world_size: Ranks that share them.
        rank: The rank this plan was made on.
        shares: Samples of each rank, by global rank: ``global_batch_size //
            world_size``, plus one on the first ``global_batch_size % world_size``
            ranks.
    """

    global_batch_size: int
    world_size: int
    rank: int
    shares: tuple[int, ...]

    @property
    def local_batch_size(self) -> int:
        """This rank's share: how many samples it takes per optimizer step."""
        return self.shares[self.rank]

    @property
    def offset(self) -> int:
        """Where this rank's samples start within the global batch (the shares of lower ranks)."""
        return sum(self.shares[: self.rank])

    @property
    def loss_scale(self) -> float:
        """What a rank multiplies the *sum* of its samples' losses by, under DDP.

        DDP averages the ranks' gradients (divides their sum by the world
        size), so ``loss = per_sample_loss.sum() * plan.loss_scale``, which is
        ``world_size / global_batch_size``, gives the gradient of the mean loss
        over the whole global batch, whatever the shares. Without DDP (the
        gradients summed by hand with ``all_reduce``), scale by
        ``1 / global_batch_size`` instead.
        """
        return self.world_size / self.global_batch_size

    def describe(self) -> str:
        """``"74 or 73 samples per rank"`` (or ``"64 samples per rank"`` when it divides)."""
        most, least = self.shares[0], self.shares[-1]
        if most == least:
            return f"{most} samples per rank"
        return f"{most} or {least} samples per rank"


def batch_plan(
    global_batch_size: int, world_size: int | None = None, rank: int | None = None
) -> BatchPlan:
    """Each rank's share of a global batch of ``global_batch_size`` at the current world size.

    When the world size does not divide the global batch, shares differ by one:
    ranks ``0 .. r-1`` (``r = global_batch_size % world_size``) take one sample
    more than the others. A job that goes on with fewer ranks, or grows back,
    keeps its global batch (and so its learning-rate schedule) this way, with
    no divisibility constraint. ``nbtools.data.DataLoader(global_batch_size=)``
    uses it to size each rank's batches.

    Args:
        global_batch_size: Samples per optimizer step over all ranks (at least
            one per rank).
        world_size: Defaults to :func:`get_world_size`.
        rank: Defaults to :func:`get_rank`.

    Raises:
        TypeError: a count that is not an integer.
        ValueError: a global batch smaller than the world (a rank would get no
            sample), or a rank outside the world.

    Example:
        >>> plan = batch_plan(512, world_size=7, rank=0)
        >>> plan.shares
        (74, 73, 73, 73, 73, 73, 73)
        >>> plan.local_batch_size, plan.describe()
        (74, '74 or 73 samples per rank')
        >>> batch_plan(512, world_size=8, rank=3).local_batch_size
        64
    """
    world = get_world_size() if world_size is None else world_size
    where = get_rank() if rank is None else rank
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("world_size", world),
        ("rank", where),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    if world < 1:
        raise ValueError(f"world_size must be at least 1, got {world}")
    if not 0 <= where < world:
        raise ValueError(f"rank {where} is outside a world of {world} ranks (0 to {world - 1})")
    if global_batch_size < world:
        raise ValueError(
            f"a global batch of {global_batch_size} samples cannot be split over {world} ranks: "
            f"each rank needs at least one sample per step. Use global_batch_size >= {world} "
            "(or fewer ranks)"
        )
    base, extra = divmod(global_batch_size, world)
    shares = tuple(base + (1 if r < extra else 0) for r in range(world))
    return BatchPlan(global_batch_size, world, where, shares)
