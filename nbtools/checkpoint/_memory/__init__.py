"""The memory tier: snapshots of the training state in node-local shared memory.

What it holds: ``_slots`` (the snapshot files: a 0700 directory per user and
job under ``/dev/shm``, 0600 slots with random names and a checksummed header,
the sweep of dead jobs) and ``_tier`` (:class:`MemoryTier`, which the manager
asks to snapshot every ``memory_every`` steps, and the restore that agrees on
the newest step every rank holds). It uses the manager half's state builder
(``_state``) and collectives, and ``nbtools._internal.holder`` to tell whether
a job's keeper process lives. Start reading at ``_tier``.
"""
