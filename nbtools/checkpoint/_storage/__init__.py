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

The rest of the package enters only through the names exported here (the
modules are this room's own): the two protocols used as a whole are exported
as namespaces, ``save_markers`` (claiming a directory for a save) and
``scratch`` (the local scratch disk).
"""

from __future__ import annotations

from nbtools.checkpoint._storage import _save_markers as save_markers
from nbtools.checkpoint._storage import _scratch as scratch
from nbtools.checkpoint._storage._coop_read import NOTE
from nbtools.checkpoint._storage._delivery import Delivery, Slice, dense_destination, saved_data
from nbtools.checkpoint._storage._layout import (
    METADATA_NAME,
    is_shard,
    parse_step_dir,
    rank_metadata_name,
    shard_name,
    shard_prefix,
    step_dir_name,
)
from nbtools.checkpoint._storage._rank_local import check_rank_local
from nbtools.checkpoint._storage._roots import check_root, skip_untrusted
from nbtools.checkpoint._storage._safe_pickle import check_weights_only, read_metadata
from nbtools.checkpoint._storage._shards import (
    file_writer,
    item_checksum,
    item_writer,
    new_writer_token,
    read_item_into,
    verify_items,
    write_shard,
)
from nbtools.checkpoint._storage._staged_read import StagedFetch, Timings
from nbtools.checkpoint._storage._target import Target, can_open, open_target
from nbtools.checkpoint._storage._transforms import StreamTransforms, descriptors_of

__all__ = [
    # where files live
    "Target",
    "open_target",
    "can_open",
    "METADATA_NAME",
    "step_dir_name",
    "parse_step_dir",
    "rank_metadata_name",
    "shard_name",
    "shard_prefix",
    "is_shard",
    "check_root",
    "skip_untrusted",
    # how a shard is written and checked
    "new_writer_token",
    "file_writer",
    "item_writer",
    "write_shard",
    "item_checksum",
    "read_item_into",
    "verify_items",
    "scratch",
    # how a save claims its directory
    "save_markers",
    "check_rank_local",
    # how a restore reads
    "NOTE",
    "StagedFetch",
    "Timings",
    "Delivery",
    "Slice",
    "dense_destination",
    "saved_data",
    "StreamTransforms",
    "descriptors_of",
    "read_metadata",
    "check_weights_only",
]
