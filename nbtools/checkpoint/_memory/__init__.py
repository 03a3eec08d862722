"""The memory tier: snapshots of the training state in node-local shared memory.

Start reading at ``_tier``. The modules, one line each:

- ``_tier``: :class:`MemoryTier`, which the manager asks to snapshot every
  ``memory_every`` steps, and which runs the snapshot's rounds in the background.
- ``_copy_behind``: the copy of parameters and optimizer state that runs behind
  training until the next optimizer step, fused with the slot's checksum.
- ``_format``: the bytes of a snapshot: tensors as raw buffers, the rest as a
  small skeleton.
- ``_shares``: replicated state snapshotted once per node, each rank of the node
  copying a share of it.
- ``_slots``: the snapshot files: a 0700 directory per user and job under
  ``/dev/shm``, 0600 slots with random names and a checksummed header.
- ``_slot_maps``: the slots' memory maps, kept from one snapshot to the next.
- ``_space``: whether a node has room for its ranks' snapshots, checked before the
  first one.
- ``_sweep``: ending jobs' snapshots: a dead job's, swept by the next one; a
  finished launch's (:func:`end_run`).
- ``_volume``: what a job's ranks know of the volume, kept beside their snapshots.
- ``_replicas``: each rank's snapshot also held by peers, sent over the job's
  process group.
- ``_restore``: the memory tier's offer and load: the newest step every rank can
  get, from its own slot or a peer's.
- ``_slot_sources``: getting the slots a restore chose: read where they are, else
  sent by a rank that has them.
- ``_in_place``: a rank's own slot restored in place: the optimizer state starts
  out in its pages.
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

from nbtools.checkpoint._memory._replicas import peers
from nbtools.checkpoint._memory._sweep import drop_jobs
from nbtools.checkpoint._memory._tier import MemoryTier

__all__ = ["MemoryTier", "peers", "end_run"]


def end_run(run_id: str, base: str | None = None) -> list[str]:
    """Remove everything the launch ``run_id`` left in shared memory on this node: its
    job directories (snapshots, replicas, half-written files, records), in this user's
    snapshot directory and in any private one it fell back to; the names removed.

    Call it on each node of the launch once the launch is over for good (its ranks are
    gone). ``base`` is the snapshot base the ranks used (default: ``NBTOOLS_SNAPSHOT_DIR``
    of this process, else ``/dev/shm``).
    """
    return drop_jobs(f"run:{run_id}|", base)
