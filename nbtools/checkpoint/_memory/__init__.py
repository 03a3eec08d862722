"""The memory tier: snapshots of the training state in node-local shared memory.

What it holds: ``_slots`` (the snapshot files: a 0700 directory per user and
job under ``/dev/shm``, 0600 slots with random names and a checksummed header,
the sweep of dead jobs) and ``_tier`` (:class:`MemoryTier`, which the manager
asks to snapshot every ``memory_every`` steps, and the restore that agrees on
the newest step every rank holds). It uses the manager half's state builder
(``_state``) and collectives, and ``nbtools._internal.holder`` to tell whether
a job's keeper process lives. Start reading at ``_tier``.

A launcher whose launch ended for good (success, failure past its restarts,
Ctrl+C, a signal) calls :func:`end_run` with the run id it gave the ranks
(``TORCHELASTIC_RUN_ID``), on every node the launch used: the run's snapshots
serve no restart any more.
"""

from __future__ import annotations

from nbtools.checkpoint._memory._sweep import drop_jobs

__all__ = ["end_run"]


def end_run(run_id: str, base: str | None = None) -> list[str]:
    """Remove everything the launch ``run_id`` left in shared memory on this node: its
    job directories (snapshots, replicas, half-written files, records), in this user's
    snapshot directory and in any private one it fell back to; the names removed.

    Call it on each node of the launch once the launch is over for good (its ranks are
    gone). ``base`` is the snapshot base the ranks used (default: ``NBTOOLS_SNAPSHOT_DIR``
    of this process, else ``/dev/shm``).
    """
    return drop_jobs(f"run:{run_id}|", base)
