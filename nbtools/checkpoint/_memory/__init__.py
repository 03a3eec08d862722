"""The memory tier: snapshots of the training state in node-local shared memory.

Start reading at ``_tier``. The modules, one line each:

- ``_tier``: :class:`MemoryTier`, the fastest tier: what the manager asks to
  snapshot every ``memory_every`` steps and to restore; it runs the rounds.
- ``_layout``: a snapshot's bytes (tensors as raw buffers, the rest as a small
  skeleton) and the shares the ranks of a node split replicated tensors into.
- ``_sharded``: DTensor state (FSDP2, tensor parallelism): each rank's local
  shards and what puts them back on the same mesh.
- ``_copy_behind``: the copy of parameters and optimizer state that runs behind
  training until the next optimizer step, fused with the slot's checksum.
- ``_slots``: the slot files (names, checksummed headers, who may trust them).
- ``_mappings``: slot files mapped into memory, the maps kept from one snapshot
  to the next, and the sink that receives peers' replicas.
- ``_directories``: where a job's slots live (a 0700 directory per user and job,
  who may trust it), the room they need, the ranks' records of the volume, and
  the sweep of ended jobs (:func:`end_run`).
- ``_replicas``: each rank's snapshot also held by peers, sent over the job's
  process group into their sinks.
- ``_choice``: the step a restore takes, the newest every rank can get, and
  getting its slots (read where they are, else sent by a rank that has them).
- ``_in_place``: the chosen slots put into the objects, a rank's own restored in
  place (the optimizer state starts out in its pages).
- ``_notes``: what the tier says: one message per condition per job.

The manager enters only through the names exported here: :class:`MemoryTier`
(a :class:`~nbtools.checkpoint._restore.Tier`: the restore policy asks it for
its offer and loads it), ``peers`` (how many nodes hold replicas) and
:func:`end_run`. It uses the manager half's state builder (``_state``) and collectives, and
``nbtools._internal.holder`` to tell whether a job's keeper process lives.

A launcher whose launch ended for good (success, failure past its restarts,
Ctrl+C, a signal) calls :func:`end_run` with the run id it gave the ranks
(``TORCHELASTIC_RUN_ID``), on every node the launch used: the run's snapshots
serve no restart any more.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nbtools.checkpoint._memory._directories import drop_jobs

if TYPE_CHECKING:  # pragma: no cover
    from nbtools.checkpoint._memory._replicas import peers
    from nbtools.checkpoint._memory._tier import MemoryTier

__all__ = ["MemoryTier", "peers", "end_run"]

# Lazy (PEP 562): the launcher's call to end_run at a launch's end imports the
# directories alone, not torch's DCP that the tier's snapshots need.
_NAMES = {
    "MemoryTier": "nbtools.checkpoint._memory._tier",
    "peers": "nbtools.checkpoint._memory._replicas",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def end_run(run_id: str, base: str | None = None) -> list[str]:
    """Remove everything the launch ``run_id`` left in shared memory on this node: its
    job directories (snapshots, replicas, half-written files, records), in this user's
    snapshot directory and in any private one it fell back to; the names removed.

    Call it on each node of the launch once the launch is over for good (its ranks are
    gone). ``base`` is the snapshot base the ranks used (default: ``NBTOOLS_SNAPSHOT_DIR``
    of this process, else ``/dev/shm``).
    """
    return drop_jobs(f"run:{run_id}|", base)
