"""Rank-local checkpoints (``dcp.save(..., use_collectives=False)``) at another world size.

Such a checkpoint has one ``__<rank>.metadata`` per saving rank and no
``.metadata``: it loads only with the world size that saved it, each rank
reading its own. Loaded with another world size, DCP reports only
``CheckpointException ranks:dict_keys([2])`` (the ranks without a file), its
reason buried in rank output. :func:`check_rank_local` says why, on every rank
alike, before DCP starts: a reader calls it when it opens a directory, outside
DCP's wrapping of errors, so the error the user sees is this one.
"""

from __future__ import annotations

from nbtools.checkpoint._storage._layout import METADATA_NAME, RANK_METADATA_RE
from nbtools.checkpoint._storage._target import Target
from nbtools.errors import CheckpointError

__all__ = ["check_rank_local"]


def _world() -> tuple[int, int] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def check_rank_local(target: Target, where: str, world: tuple[int, int] | None = None) -> None:
    """Refuse to load a rank-local checkpoint with a world size other than the one that saved it.

    Args:
        target: The checkpoint directory.
        where: How to name it in the error.
        world: ``(rank, world_size)`` of this process; default: the default
            process group's (nothing is checked without one).

    Raises:
        CheckpointError: ``target`` holds rank-local metadata of N ranks, no
            ``.metadata``, and this job does not have exactly those N ranks.
            Every rank raises it (they all see the same files), so none waits
            in a collective for the others.
    """
    world = world if world is not None else _world()
    if world is None:
        return
    try:
        if target.exists(METADATA_NAME):
            return
        names = sorted(n for n in target.listdir() if RANK_METADATA_RE.match(n))
    except (FileNotFoundError, NotADirectoryError):
        return  # no directory yet: DCP reports that
    if not names:
        return
    saved = sorted(int(RANK_METADATA_RE.match(n).group(1)) for n in names)  # type: ignore[union-attr]
    rank, size = world
    if saved == list(range(size)):
        return
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise CheckpointError(
        f"{where} is a rank-local checkpoint (saved with dcp.save(..., "
        f"use_collectives=False)) of {len(saved)} rank(s) ({shown}), and this job has "
        f"{size} ranks (this is rank {rank}). A rank-local checkpoint loads only with the "
        f"world size that saved it, each rank reading its own file: load it on {len(saved)} "
        "ranks, or save with use_collectives=True (the default) to load at any world size"
    )
