"""``NbtoolsCheckpoint``: recovery from memory for Hugging Face's ``Trainer`` in one line.

Example:
    >>> from transformers import Trainer, TrainingArguments
    >>> from nbtools import distributed
    >>> from nbtools.integrations.transformers import NbtoolsCheckpoint
    >>> @distributed(processes=2, max_restarts=3)
    ... def fit():
    ...     trainer = Trainer(
    ...         model=model, args=TrainingArguments("out", use_cpu=True), train_dataset=data,
    ...         callbacks=[NbtoolsCheckpoint("/vol/run1/ckpt", every=200, memory_every=10)],
    ...     )
    ...     trainer.train()  # a restarted attempt resumes by itself
    >>> fit.distributed()  # doctest: +SKIP

What it does:

- Every step the callback hands the model, the optimizer, the LR scheduler and the
  trainer's progress (``TrainerState``: global step, epoch, log history, the loss
  being accumulated for the next log) to a
  :class:`~nbtools.checkpoint.CheckpointManager`: a volume checkpoint every
  ``every`` steps, a snapshot in node memory every ``memory_every`` steps, the RNG of
  Python, NumPy, torch and CUDA of every rank with both.
- ``trainer.train()`` with no ``resume_from_checkpoint`` restores the newest of them
  (memory, a peer's replica or the volume) before the first step, then does what
  the Trainer's own resume does: it skips the epochs and the batches already
  trained on (``skip_first_batches``, every sample once per epoch) and sets the RNG
  back after the skip. A restarted attempt therefore trains again at most
  ``memory_every`` steps, and ends with the weights an uninterrupted run ends with.
  A fresh root starts at step 0 with no error.
- An explicit ``resume_from_checkpoint`` wins: the Trainer loads it, nbtools
  restores nothing (and keeps saving).
- The Trainer's own ``save_steps`` checkpoints may stay on; they are independent.
- ``train()`` returning closes the manager: it saves the last step to the volume
  and drops the snapshots. An exception keeps them for the restart.

Importing this module imports ``transformers`` and wraps ``Trainer.train`` once; a
Trainer without an ``NbtoolsCheckpoint`` among its callbacks runs as before.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from nbtools import events
from nbtools.checkpoint import CheckpointManager
from nbtools.errors import CheckpointError
from nbtools.integrations._common import Options, Resumed, RngState, announce

__all__ = ["NbtoolsCheckpoint"]

#: Fields of ``TrainerState`` that a run's progress changes (the rest comes from its args).
_PROGRESS = (
    "global_step",
    "epoch",
    "log_history",
    "total_flos",
    "num_input_tokens_seen",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)
#: Passed to the Trainer's resume path in place of a checkpoint directory.
_FROM_NBTOOLS = "<nbtools>"
_WRAPPED = "_nbtools_checkpoint_train"


class _Progress:
    """The trainer's progress as a stateful object the manager saves beside the model."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        fields = {name: getattr(trainer.state, name, None) for name in _PROGRESS}
        loss = getattr(trainer, "_tr_loss", None)
        return {
            "state": json.dumps(fields),
            "tr_loss": float(loss.item()) if isinstance(loss, torch.Tensor) else 0.0,
            "total_loss": float(getattr(trainer, "_total_loss_scalar", 0.0)),
            "last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
            "flos": float(getattr(trainer, "current_flos", 0.0)),
        }

    def load_state_dict(self, blob: dict[str, Any]) -> None:
        trainer = self.trainer
        for name, value in json.loads(blob["state"]).items():
            if hasattr(trainer.state, name):
                setattr(trainer.state, name, value)
        device = trainer.args.device
        trainer._tr_loss = torch.tensor(float(blob["tr_loss"]), device=device)
        trainer._total_loss_scalar = float(blob["total_loss"])
        trainer._globalstep_last_logged = int(blob["last_logged"])
        trainer._initial_global_step = int(trainer.state.global_step)
        trainer.current_flos = float(blob["flos"])


class NbtoolsCheckpoint(TrainerCallback):  # type: ignore[misc]
    """A ``Trainer`` callback that checkpoints through nbtools and resumes by itself.

    Args:
        root: Directory (local, NFS, FUSE) or fsspec URL of the checkpoints.
        every: Steps between volume checkpoints (None: only the one ``train()``
            saves when it returns).
        memory_every: Steps between snapshots in node memory (None: none); a
            restarted attempt trains again at most this many steps.
        keep: Volume checkpoints to keep (None: all).
        replicas: Peers holding each rank's snapshot (see ``CheckpointManager``).
        async_save: Save to the volume in the background.
        takeover: Take over a root whose writer looks alive.

    Attributes:
        restored_step: The step ``train()`` resumed after, or None.
        restored_tier: ``"memory"``, ``"replica"`` or ``"volume"``, or None.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every: int | None = None,
        memory_every: int | None = None,
        *,
        keep: int | None = None,
        replicas: int | None = None,
        async_save: bool = True,
        takeover: bool = False,
    ) -> None:
        self.options = Options(root, every, memory_every, keep, replicas, async_save, takeover)
        self.restored_step: int | None = None
        self.restored_tier: str | None = None
        self._trainer: Any = None
        self._restore = False
        self._manager: CheckpointManager | None = None
        self._objects: dict[str, Any] = {}
        self._resumed: Resumed | None = None
        self._rng: RngState | None = None

    # --- what the wrapped train() calls -----------------------------------------

    def _begin(self, trainer: Any, restore: bool) -> None:
        self._trainer, self._restore = trainer, restore
        self._resumed = None

    def _failed(self, exc: BaseException) -> None:
        """Close after an exception: no final save, snapshots kept for the restart."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.__exit__(type(exc), exc, exc.__traceback__)

    # --- callback events ---------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer
        if trainer is None:
            raise CheckpointError(
                "NbtoolsCheckpoint runs only inside Trainer.train(); import it from "
                "nbtools.integrations.transformers before calling train()"
            )
        if self._manager is not None:  # a previous train() that did not end: release it
            self._manager.close(final_save=False)
        self._manager = self.options.open()
        optimizer = trainer.optimizer
        self._objects = {
            "model": trainer.model,
            # accelerate's AcceleratedOptimizer: the optimizer it wraps holds the state
            "optimizer": getattr(optimizer, "optimizer", optimizer),
            "lr_scheduler": trainer.lr_scheduler,
            "trainer_state": _Progress(trainer),
        }
        if not self._restore:
            return
        start = self._manager.restore(**self._objects)
        self.restored_step = self._manager.restored_step
        self.restored_tier = self._manager.restored_tier
        announce("HF Trainer", self._manager)
        if start > 0:
            self._resumed = Resumed(int(state.global_step), RngState())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._manager is not None:
            self._manager.maybe_save(int(state.global_step), **self._objects)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()

    # --- the resume path of the Trainer, fed from nbtools -----------------------

    def _run_epoch(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        resumed = self._resumed
        if resumed is None:
            return original(*args, **kwargs)
        trainer = self._trainer
        per_epoch = int(kwargs["num_update_steps_per_epoch"])
        first = resumed.step // per_epoch
        if int(kwargs["epoch"]) < first:  # trained before the restore: skipped, as HF does
            return None
        self._resumed = None
        steps = (resumed.step % per_epoch) * trainer.args.gradient_accumulation_steps
        kwargs.update(
            resume_from_checkpoint=_FROM_NBTOOLS,
            epochs_trained=first,
            steps_trained_in_current_epoch=steps,
        )
        self._rng = resumed.rng
        return original(*args, **kwargs)

    def _load_rng_state(self, original: Any, checkpoint: str | None) -> None:
        if checkpoint != _FROM_NBTOOLS:
            original(checkpoint)
            return
        rng, self._rng = self._rng, None
        if rng is not None:
            rng.apply()


def _ours(trainer: Any) -> NbtoolsCheckpoint | None:
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, NbtoolsCheckpoint)]
    if len(found) > 1:
        raise CheckpointError(
            f"this Trainer has {len(found)} NbtoolsCheckpoint callbacks; pass one (one root)"
        )
    return found[0] if found else None


def _wrap_train() -> None:
    original = Trainer.train
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        callback = _ours(self)
        if callback is None:
            return original(self, resume_from_checkpoint, *args, **kwargs)
        callback._begin(self, restore=resume_from_checkpoint in (None, False))
        run_epoch, load_rng = type(self)._run_epoch, type(self)._load_rng_state
        self._run_epoch = functools.partial(callback._run_epoch, run_epoch.__get__(self))
        self._load_rng_state = functools.partial(callback._load_rng_state, load_rng.__get__(self))
        # An evaluation inside train() is a named phase: the hang watch gives it a long bound.
        self.evaluate = events.phase("evaluate")(type(self).evaluate.__get__(self))
        try:
            return original(self, resume_from_checkpoint, *args, **kwargs)
        except BaseException as exc:
            callback._failed(exc)
            raise
        finally:
            for name in ("_run_epoch", "_load_rng_state", "evaluate"):
                self.__dict__.pop(name, None)
            callback._trainer = None

    setattr(train, _WRAPPED, True)
    Trainer.train = train  # type: ignore[method-assign]


_wrap_train()
