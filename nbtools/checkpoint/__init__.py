"""Checkpointing: staged volume storage, async saves, exact automatic resume.

- :class:`VolumeWriter` / :class:`VolumeReader`: DCP storage backends for a local
  or mounted directory or an fsspec URL; they stage through local disk, move data
  in parallel, verify checksums, and publish ``.metadata`` last.
- :class:`CheckpointManager`: ``root/step_<N>/`` checkpoints saved in the
  background, kept to ``keep``, restored exactly (model, optimizer, stateful
  objects, RNG streams, extra, MLflow run id).
- :func:`find_latest_valid`: the newest complete checkpoint under a root;
  :func:`latest_checkpoint`: the same, with its step.
- :func:`export`: model weights as one ``torch.save`` file.
"""

from __future__ import annotations

from nbtools.checkpoint.discovery import find_latest_valid, latest_checkpoint
from nbtools.checkpoint.export import export
from nbtools.checkpoint.manager import CheckpointManager
from nbtools.checkpoint.reader import VolumeReader
from nbtools.checkpoint.writer import VolumeWriter

__all__ = [
    "VolumeWriter",
    "VolumeReader",
    "CheckpointManager",
    "find_latest_valid",
    "latest_checkpoint",
    "export",
]
