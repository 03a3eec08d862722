"""``NbtoolsCheckpoint``: recovery from memory for Lightning's ``Trainer`` in one line.

Example:
    >>> import lightning as L
    >>> from nbtools import distributed
    >>> from nbtools.integrations.lightning import NbtoolsCheckpoint
    >>> @distributed(processes=2, max_restarts=3)
    ... def fit():
    ...     trainer = L.Trainer(
    ...         max_epochs=3, accelerator="cpu", devices=2, strategy="ddp",
    ...         callbacks=[NbtoolsCheckpoint("/vol/run1/ckpt", every=200, memory_every=10)],
    ...     )
    ...     trainer.fit(model, datamodule)  # a restarted attempt resumes by itself
    >>> fit.distributed()  # doctest: +SKIP

What it does:

- After each training batch the callback hands the ``LightningModule``, every
  optimizer and LR scheduler, and the fit loop's progress (epoch, global step, batch
  counters, as Lightning's own checkpoints hold it) to a
  :class:`~nbtools.checkpoint.CheckpointManager`: a volume checkpoint every ``every``
  steps, a snapshot in node memory every ``memory_every`` steps, with the RNG of
  Python, NumPy, torch and CUDA of every rank as the next batch will use it.
- ``trainer.fit(...)`` with no ``ckpt_path`` restores the newest of them (memory, a
  peer's replica or the volume) once the optimizers exist, before the first batch.
  The loaders Lightning builds (from the ``LightningModule`` or the datamodule, with
  the ``DistributedSampler`` it adds, or a shuffling ``RandomSampler`` on one device)
  skip the batches of the current epoch already trained on, in the epoch's order, so
  every sample is seen once per epoch, and the RNG is set back after that skip. A restarted attempt trains again at most ``memory_every`` steps and
  ends with the weights of an uninterrupted run. A fresh root starts at step 0.
- An explicit ``ckpt_path`` wins: Lightning loads it, nbtools restores nothing
  (and keeps saving). Lightning's own ``ModelCheckpoint`` may stay on.
- ``fit`` returning closes the manager: the last step is saved to the volume and
  the snapshots are dropped. An exception keeps them for the restart.

Loops whose position Lightning cannot count (an iterable dataset without a length)
are resumed at the right step and epoch, but their data starts where their
iterator starts.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from nbtools import events
from nbtools.checkpoint import CheckpointManager
from nbtools.integrations._common import Options, Resumed, RngState, announce

__all__ = ["NbtoolsCheckpoint"]


class _Loops:
    """The fit loop's progress as a stateful object: the state Lightning's checkpoints hold
    under ``"loops"``, taken at the end of the batch that made the step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.taken: dict[str, Any] = {}
        #: torch's RNG as the epoch's first batch was fetched: a ``RandomSampler``
        #: without a generator of its own draws the epoch's order from it.
        self.epoch_rng: torch.Tensor | None = None

    def take(self) -> None:
        self.taken = {"fit_loop": self.trainer.fit_loop.state_dict()}
        if self.epoch_rng is not None:
            self.taken["epoch_rng"] = self.epoch_rng

    def state_dict(self) -> dict[str, Any]:
        return self.taken

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state["fit_loop"])
        self.taken = dict(state)


def _set_epoch(loader: Any, epoch: int) -> None:
    """Set the epoch of the loader's samplers (a ``DistributedSampler`` shuffles by it)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class NbtoolsCheckpoint(Callback):  # type: ignore[misc]
    """A Lightning ``Trainer`` callback that checkpoints through nbtools and resumes by itself.

    Args:
        root: Directory (local, NFS, FUSE) or fsspec URL of the checkpoints.
        every: Steps between volume checkpoints (None: only the one ``fit`` saves
            when it returns).
        memory_every: Steps between snapshots in node memory (None: none); a
            restarted attempt trains again at most this many steps.
        keep: Volume checkpoints to keep (None: all).
        replicas: Peers holding each rank's snapshot (see ``CheckpointManager``).
        async_save: Save to the volume in the background.
        takeover: Take over a root whose writer looks alive.

    Attributes:
        restored_step: The global step ``fit`` resumed after, or None.
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
        self._manager: CheckpointManager | None = None
        self._objects: dict[str, Any] = {}
        self._loops: _Loops | None = None
        self._pending: int | None = None  # the step of a batch that ended, saved at the next
        self._skip = 0  # batches of the current epoch to skip after a restore
        self._resumed: Resumed | None = None
        self._last_step = -1
        self._evaluating: events.phase | None = None

    # --- start: restore once the optimizers exist ----------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._manager is not None:  # a previous fit() that did not end: release it
            self._manager.close(final_save=False)
        self._manager = self.options.open()
        self._loops = _Loops(trainer)
        self._objects = {"model": pl_module}
        for i, optimizer in enumerate(trainer.optimizers):
            self._objects[f"optimizer_{i}"] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            self._objects[f"scheduler_{i}"] = config.scheduler
        self._objects["loops"] = self._loops
        self._pending, self._skip, self._resumed = None, 0, None
        self._last_step = -1
        if trainer.ckpt_path is not None:  # the user's own checkpoint wins
            return
        start = self._manager.restore(**self._objects)
        self.restored_step = self._manager.restored_step
        self.restored_tier = self._manager.restored_tier
        announce("Lightning Trainer", self._manager)
        if start == 0:
            return
        # Batches of the saved step's epoch that had been trained on when it ended.
        self._skip = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        # Lightning warns that a plain loader resumed mid-epoch starts the epoch again;
        # this callback skips what was trained on (on_train_start), so the warning is wrong.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended")
        self._resumed = Resumed(int(self.restored_step or 0), RngState())
        self._last_step = int(trainer.global_step)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        skip, self._skip = self._skip, 0
        total = trainer.num_training_batches
        if skip <= 0 or not isinstance(total, int) or skip >= total:
            return  # at an epoch's end the next epoch starts afresh
        loop = trainer.fit_loop
        epoch = loop.epoch_progress.current.processed
        assert loop._combined_loader is not None and self._loops is not None
        for loader in loop._combined_loader.flattened:  # as Lightning does before the epoch
            _set_epoch(loader, epoch)
        epoch_rng = self._loops.taken.get("epoch_rng")
        if isinstance(epoch_rng, torch.Tensor):
            # The epoch's order comes out as it did: from the RNG it was drawn from, by an
            # iterator made as the uninterrupted run made it (after the epoch's start, it
            # draws its own seed first; the first epoch's was made before).
            torch.set_rng_state(epoch_rng)
            if epoch > 0:
                iter(loop._data_fetcher)
        iterator = loop._data_fetcher.iterator
        for _ in range(skip):
            next(iterator)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._loops is not None:
            self._loops.epoch_rng = torch.get_rng_state()

    # --- every batch ---------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, index: int) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            resumed.rng.apply()  # after the loader's iterator drew its seed and skipped
        self._save_pending()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        # Saved when the next batch starts: the RNG is then the one that batch uses.
        step = int(trainer.global_step)
        if self._manager is not None and self._loops is not None and step != self._last_step:
            self._loops.take()  # once per optimizer step, not per accumulated batch
            self._pending = self._last_step = step

    def _save_pending(self) -> None:
        step, self._pending = self._pending, None
        if step is not None and self._manager is not None:
            self._manager.maybe_save(step, **self._objects)

    # --- evaluation: a named phase, so the hang watch never takes it for a hang ----

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._end_evaluation()
        self._evaluating = events.phase("evaluate").__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_evaluation()

    def _end_evaluation(self) -> None:
        evaluating, self._evaluating = self._evaluating, None
        if evaluating is not None:
            evaluating.__exit__(None, None, None)

    # --- end -----------------------------------------------------------------------

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._save_pending()
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end_evaluation()
        manager, self._manager = self._manager, None
        if manager is not None:  # no final save; snapshots kept for the restart
            manager.__exit__(type(exception), exception, exception.__traceback__)
