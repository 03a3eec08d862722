"""What the trainer callbacks share: their options, the manager they open, the RNG they
put back once the trainer has repositioned its data."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from nbtools._internal.log import get_logger
from nbtools.checkpoint import CheckpointManager

__all__ = ["Options", "Resumed", "RngState", "announce"]

_log = get_logger("integrations")


@dataclass(frozen=True)
class Options:
    """The ``CheckpointManager`` a callback opens when training starts."""

    root: str | os.PathLike[str]
    every: int | None
    memory_every: int | None
    keep: int | None
    replicas: int | None
    async_save: bool
    takeover: bool

    def open(self) -> CheckpointManager:
        """A manager over ``root`` (made in the rank, where the process group exists)."""
        return CheckpointManager(
            self.root,
            every=self.every,
            keep=self.keep,
            async_save=self.async_save,
            takeover=self.takeover,
            memory_every=self.memory_every,
            replicas=self.replicas,
        )


class RngState:
    """The Python, NumPy, torch and CUDA generators of this process, as they are now.

    A restore sets them while the trainer has yet to build its data iterator and skip
    the batches already trained on, which may draw from them; they are captured right
    after the restore and set again just before the first step that trains.
    """

    def __init__(self) -> None:
        self.python = random.getstate()
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy comes with every trainer
            self.numpy: Any = None
        else:
            self.numpy = np.random.get_state()

    def apply(self) -> None:
        """Set every generator back to the captured state."""
        random.setstate(self.python)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)


@dataclass
class Resumed:
    """A restore that the trainer has yet to act on: the steps done and the RNG to set."""

    step: int
    rng: RngState


def announce(trainer: str, manager: CheckpointManager) -> None:
    """Say, once per job, which step a trainer resumed from and from which tier."""
    if manager.restored_step is None:
        _log.info("%s: no checkpoint under %s; training starts at step 0", trainer, manager.root)
        return
    _log.warning(
        "%s resumed after step %d from %s (%s)",
        trainer,
        manager.restored_step,
        manager.restored_tier,
        manager.root,
    )
