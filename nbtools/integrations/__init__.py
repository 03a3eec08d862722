"""One-line recovery for the trainers people already use.

Each module is imported only by the user, never by ``import nbtools``: importing it
imports the library it integrates.

- :mod:`nbtools.integrations.transformers`: ``NbtoolsCheckpoint``, a callback for
  Hugging Face's ``Trainer``.
- :mod:`nbtools.integrations.lightning`: ``NbtoolsCheckpoint``, a callback for
  Lightning's ``Trainer``.

Both save through :class:`nbtools.checkpoint.CheckpointManager` (volume checkpoints
and, with ``memory_every``, snapshots in node memory) and, on a restarted attempt of
``@distributed(max_restarts=...)`` or ``%%autoresume``, resume the training by
themselves from the newest tier.

Loops of the user's own under Lightning Fabric or accelerate need no module here:
:class:`~nbtools.checkpoint.CheckpointManager` takes what ``fabric.setup()``,
``fabric.setup_dataloaders()`` and ``accelerator.prepare()`` return as it is.
"""

from __future__ import annotations

__all__: list[str] = []
