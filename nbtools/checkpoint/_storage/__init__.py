"""How checkpoint bytes move: the storage half under ``writer.py`` and ``reader.py``.

What it holds, from the bottom up:

- where files live: ``_target`` (the :class:`Target` protocol, local and fsspec
  targets, each owning its ranged read), ``_mounts`` (local, network or FUSE),
  ``_fsspec_compat`` (the one private fsspec name used), ``_layout`` (file names
  of a checkpoint directory) and ``_roots`` (which files of a root to trust);
- how a shard is written and checked: ``_shards`` (items, CRC-32 checksums,
  writer tokens) and ``_scratch`` (the local scratch disk a save or load stages
  through, its space checks, and the sweep of a dead writer's leftovers);
- how a save claims its directory: ``_save_markers``, and ``_rank_local`` for
  DCP's rank-local saves;
- how a restore reads: ``_ranges`` (ranged reads watched for stalls),
  ``_coop_read`` (each range several ranks need read once and handed over),
  ``_staged_read`` (the fetch into scratch that ties them together),
  ``_delivery`` (ranges handed to the load without staging), ``_transforms``
  (DCP stream transforms) and ``_safe_pickle`` (metadata read without running
  foreign pickle).

It uses only ``nbtools._internal``, ``nbtools.errors``, torch's DCP and fsspec;
nothing here imports the manager half (state, host buffers, lease, retention),
which sits above it. Start reading at ``_target`` and ``_shards``, then
``_staged_read`` for the restore path.
"""
