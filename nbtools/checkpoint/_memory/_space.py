"""Whether a node has room for its ranks' memory snapshots, checked before the first one.

Each rank of a node keeps two slots of its own and two of each peer whose
replicas it holds; together they must fit in the snapshot filesystem (a
container's ``/dev/shm`` is often 64 MB) and in half of the node's available
memory, counting what this rank's slots already take. When they do not, the
tier turns itself off with one warning that says what it needs and what to
change, before anything is written.
"""

from __future__ import annotations

import shutil

from nbtools import runtime

__all__ = ["MEMORY_SHARE", "available_memory", "shortage"]

#: Fraction of the node's available memory the snapshots of its ranks may take.
MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """The node's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def shortage(directory: str, user: str, size: int, peers: int, held: int) -> str | None:
    """Why the snapshots of this node's ranks do not fit, or None when they do.

    Args:
        directory: The job's snapshot directory (its filesystem is checked).
        user: The user's snapshot directory, named in the message.
        size: One slot's bytes (header, tensors, skeleton).
        peers: Peers whose replicas this rank holds (two slots each).
        held: Bytes this rank's slots and replicas already take there.
    """
    ranks = max(1, runtime.get_local_world_size())
    copies = 2 * (1 + peers)
    need = copies * ranks * size
    free = shutil.disk_usage(directory).free
    memory = available_memory()
    if need <= free + held and (memory is None or need <= MEMORY_SHARE * memory + held):
        return None
    return (
        f"{copies} snapshots for each of the {ranks} rank(s) of this node (its own two"
        + (f" and two of each of the {peers} peer(s) it holds" if peers else "")
        + f") need about {need / 2**20:.1f} MiB ({size / 2**20:.1f} MiB each) in "
        f"{user}, but that filesystem has {free / 2**20:.1f} MiB free"
        + (f" and the node {memory / 2**20:.1f} MiB of memory available" if memory else "")
        + ". Give the shared-memory mount more room (docker run --shm-size=...), point "
        "NBTOOLS_SNAPSHOT_DIR at a larger tmpfs, keep fewer replicas, or snapshot less state"
    )
