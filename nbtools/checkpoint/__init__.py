"""Checkpointing: staged volume storage, async saves, exact automatic resume.

- :class:`VolumeWriter` / :class:`VolumeReader`: DCP storage backends for a local
  or mounted directory or an fsspec URL; they stage through local disk, move data
  in parallel, verify checksums, and publish ``.metadata`` last.
- :class:`CheckpointManager`: ``root/step_<N>/`` checkpoints saved in the
  background, kept to ``keep``, restored exactly (model, optimizer, stateful
  objects, RNG streams, extra, MLflow run id); :class:`CheckpointConfig` holds its
  settings, frozen and checked once.
- :func:`find_latest_valid`: the newest complete checkpoint under a root;
  :func:`latest_checkpoint`: the same, with its step.
- :func:`export`: model weights as one ``torch.save`` file.

How the package is laid out, in two halves:

- ``_storage/``, how bytes move: the storage targets, shards and checksums, the
  scratch disk, save markers, ranged and read-once restore reads. It imports
  nothing from the rest of the package; its ``__init__`` gives the tour.
- ``writer.py`` and ``reader.py``, the DCP storage backends built on it, with
  ``discovery.py`` (which checkpoints a root holds) and ``export.py``.
- the manager half, above them: ``manager.py`` (start reading here) with
  ``_saver`` (the volume saves the manager owns, start to publish), ``_objects``
  (the objects passed, sorted by kind, trainers' wrappers seen through and
  checked), ``_state`` (what a checkpoint holds of them: per-rank blob, RNG
  streams),
  ``_host_buffers`` (the reused copy an async save stages from), ``_restore``
  (one restore policy over the tiers: the newest step, from the fastest tier
  holding it), ``_volume_tier`` (the checkpoints under the root as a tier: the
  newest one that verifies), ``_lease`` (one writer per root),
  ``_retention`` (keeping ``keep``), ``_checks``, ``_collective``, ``_forks``,
  ``_report`` and ``_dcp`` (how nbtools calls DCP: its errors, its
  single-process warning); and ``_memory/``, the memory tier
  (``memory_every``): snapshots in node-local shared memory that a restarted
  rank restores from before the volume.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The front door is lazy (PEP 562): importing the package, as a launch's end does to
# drop the memory tier's snapshots, imports neither DCP nor the manager until one of
# these names is first used.
_NAMES = {
    "VolumeWriter": "nbtools.checkpoint.writer",
    "VolumeReader": "nbtools.checkpoint.reader",
    "CheckpointManager": "nbtools.checkpoint.manager",
    "CheckpointConfig": "nbtools.checkpoint._config",
    "find_latest_valid": "nbtools.checkpoint.discovery",
    "latest_checkpoint": "nbtools.checkpoint.discovery",
    "export": "nbtools.checkpoint.export",
}

if TYPE_CHECKING:  # pragma: no cover
    from nbtools.checkpoint._config import CheckpointConfig
    from nbtools.checkpoint.discovery import find_latest_valid, latest_checkpoint
    from nbtools.checkpoint.export import export
    from nbtools.checkpoint.manager import CheckpointManager
    from nbtools.checkpoint.reader import VolumeReader
    from nbtools.checkpoint.writer import VolumeWriter

__all__ = [
    "VolumeWriter",
    "VolumeReader",
    "CheckpointManager",
    "CheckpointConfig",
    "find_latest_valid",
    "latest_checkpoint",
    "export",
]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'nbtools.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found here from now on, without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
