"""The demo's training function: DDP on cached volume data, async checkpoints, MLflow, a kill.

:func:`train` is meant for ``@distributed(processes=2, max_restarts=2)``. On the
first attempt rank ``kill_rank`` SIGKILLs itself after step ``kill_at``; the
launcher restarts the group, the checkpoint manager restores model, optimizer
and data position (from the node-local memory snapshot when every rank holds
one newer than the volume's checkpoint), the MLflow run continues, and training
finishes. Every rank
appends what it consumed at each step to ``records/rank<R>.jsonl`` so that the
exactly-once property can be checked afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from nbtools import events, runtime
from nbtools._demo.samples import FEATURES, DecodedSamples

__all__ = ["KILLED_KIND", "RESUMED_KIND", "DemoConfig", "train", "steps_per_epoch"]

#: The event the killed rank emits just before its SIGKILL (its step: the last it trained).
KILLED_KIND = "sigkill"
#: The event rank 0 emits when the first step after a restore is done on every rank.
RESUMED_KIND = "resumed"

_MLFLOW_SCRUBBED = ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")


@dataclass(frozen=True)
class DemoConfig:
    """Where one training run reads and writes, and how it trains.

    Attributes:
        volume: Directory of sample files (see ``make_volume``).
        run_dir: This run's directory: ``checkpoints/``, ``records/``, ``staging/``.
        cache_dir: Local cache of the volume's files (shared by runs and ranks).
        tracking_uri: MLflow tracking URI; the loss goes there from rank 0.
        experiment: MLflow experiment of the run.
        run_name: MLflow run name.
        epochs: Passes over the data.
        batch_size: Samples per rank per step.
        every: Checkpoint to the volume every this many steps.
        memory_every: Snapshot the same state into node-local memory every this
            many steps (None: volume checkpoints only).
        keep: Checkpoints kept.
        kill_at: On the first attempt, rank ``kill_rank`` SIGKILLs itself after
            this step (None: never).
        kill_rank: The rank that is killed.
        seed: Seed of the model's initialisation and of the data order.
        lr: Learning rate of Adam.
        hidden: Width of the hidden layer.
        use_cuda: Train on ``cuda:LOCAL_RANK`` when CUDA is available.
        verbose: Print one line per epoch and the kill (rank 0 and the killed rank).
    """

    volume: str
    run_dir: str
    cache_dir: str
    tracking_uri: str
    experiment: str = "nbtools-demo"
    run_name: str = "recovered"
    epochs: int = 3
    batch_size: int = 8
    every: int = 4
    memory_every: int | None = 2
    keep: int = 2
    kill_at: int | None = None
    kill_rank: int = 1
    seed: int = 0
    lr: float = 0.02
    hidden: int = 32
    use_cuda: bool = True
    verbose: bool = True

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def records(self) -> str:
        return os.path.join(self.run_dir, "records")

    @property
    def staging(self) -> str:
        return os.path.join(self.run_dir, "staging")

    def replace(self, **changes: Any) -> DemoConfig:
        """A copy with some fields changed."""
        return DemoConfig(**{**asdict(self), **changes})


def steps_per_epoch(samples: int, world_size: int, batch_size: int) -> int:
    """Steps in one epoch; the samples must split evenly into full batches on every rank."""
    per_step = world_size * batch_size
    if samples % per_step:
        raise ValueError(
            f"{samples} samples do not split into full batches of {batch_size} on "
            f"{world_size} ranks; use a sample count that is a multiple of {per_step}"
        )
    return samples // per_step


class _NoTracker:
    """Stands in for the MLflow logger on ranks that do not log."""

    run_id = None

    def log_metric(self, key: str, value: Any, step: int | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


def _tracker(cfg: DemoConfig, run_id: str | None) -> Any:
    if not runtime.is_main_process():
        return _NoTracker()  # other ranks do not even import mlflow
    from nbtools.tracking import MlflowLogger

    return MlflowLogger(cfg.experiment, run_name=cfg.run_name, run_id=run_id)


@contextlib.contextmanager
def _tracking_environment(uri: str) -> Iterator[None]:
    """Point MLflow at ``uri`` for the run and start a new run unless a checkpoint says which."""
    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", *_MLFLOW_SCRUBBED)}
    os.environ["MLFLOW_TRACKING_URI"] = uri
    for name in _MLFLOW_SCRUBBED:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _device(cfg: DemoConfig) -> torch.device:
    if cfg.use_cuda and torch.cuda.is_available():
        return torch.device("cuda", runtime.get_local_rank())
    return torch.device("cpu")


def _model(cfg: DemoConfig, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every attempt
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, cfg.hidden), torch.nn.Tanh(), torch.nn.Linear(cfg.hidden, 1)
    )
    return net.to(device)


def train(cfg: DemoConfig) -> dict[str, Any]:
    """Train, checkpointing every ``cfg.every`` steps; resume from the newest checkpoint.

    Returns:
        ``rank``, ``restart`` (attempt index), ``restored_step`` (None when fresh),
        ``restored_tier`` (``"memory"`` or ``"volume"``; None when fresh),
        ``run_id`` (rank 0's MLflow run), ``steps`` and, on rank 0, ``params``
        (the final weights on the CPU).
    """
    from torch.nn.parallel import DistributedDataParallel

    from nbtools.checkpoint import CheckpointManager
    from nbtools.data import DataLoader, VolumeDataset

    rank, world = runtime.get_rank(), runtime.get_world_size()
    device = _device(cfg)
    for path in (cfg.records, cfg.staging):
        os.makedirs(path, exist_ok=True)
    net = _model(cfg, device)
    model = net
    if runtime.is_distributed() and world > 1:
        model = DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    files = VolumeDataset(cfg.volume, shuffle=True, seed=cfg.seed, cache_dir=cfg.cache_dir)
    loader = DataLoader(DecodedSamples(files), batch_size=cfg.batch_size, num_workers=0)
    per_epoch = steps_per_epoch(len(files), world, cfg.batch_size)
    total = cfg.epochs * per_epoch
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader}

    with _tracking_environment(cfg.tracking_uri), contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(
            CheckpointManager(
                cfg.checkpoints,
                every=cfg.every,
                keep=cfg.keep,
                staging_dir=cfg.staging,
                memory_every=cfg.memory_every,
            )
        )
        stack.callback(loader.close)
        step = ckpt.restore(**state)
        tracker = _tracker(cfg, ckpt.mlflow_run_id)
        stack.push(lambda kind, exc, tb: tracker.close("FINISHED" if kind is None else "FAILED"))
        attempt = runtime.get_restart_count()
        records = stack.enter_context(
            open(os.path.join(cfg.records, f"rank{rank}.jsonl"), "a", buffering=1)
        )
        if cfg.verbose and rank == 0 and ckpt.restored_step is not None:
            where = (
                "the node-local memory snapshot"
                if ckpt.restored_tier == "memory"
                else f"{ckpt.root}/step_{ckpt.restored_step}"
            )
            print(
                f"attempt {attempt}: restored step {ckpt.restored_step} from "
                f"{ckpt.restored_tier} ({where}), resuming at step {step} of {total}"
            )
        loss_fn = torch.nn.MSELoss()
        resuming = ckpt.restored_step is not None  # until the first step after the restore
        while step < total:
            for ids, x, y in loader:
                loss = loss_fn(model(x.to(device)), y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                mean = loss.detach().clone()
                if runtime.is_distributed():
                    dist.all_reduce(mean)
                value = float(mean) / world
                if resuming and rank == 0:  # every rank is past this step's all-reduce
                    events.emit(RESUMED_KIND, f"first step after the restore: {step}", step=step)
                    resuming = False
                record: dict[str, Any] = {"attempt": attempt, "step": step}
                record.update(epoch=step // per_epoch, rank=rank, ids=ids.tolist(), loss=value)
                records.write(json.dumps(record) + "\n")
                tracker.log_metric("loss", value, step=step)
                if step % cfg.every == 0 or (cfg.memory_every and step % cfg.memory_every == 0):
                    # A checkpoint or snapshot of this step may exist only once its loss
                    # is stored: the resumed run never repeats it, so the value would be lost.
                    tracker.flush()
                ckpt.maybe_save(step, **state)
                if cfg.verbose and rank == 0 and (step + 1) % per_epoch == 0:
                    print(f"epoch {step // per_epoch} done: step {step}, loss {value:.4f}")
                if attempt == 0 and step == cfg.kill_at and rank == cfg.kill_rank:
                    if cfg.verbose:
                        print(f"step {step}: SIGKILL to myself (pid {os.getpid()})")
                    events.emit(KILLED_KIND, f"rank {rank} SIGKILLs itself", step=step)
                    events.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                step += 1
                if step >= total:
                    break
        run_id = tracker.run_id
    return {
        "rank": rank,
        "restart": attempt,
        "restored_step": ckpt.restored_step,
        "restored_tier": ckpt.restored_tier,
        "run_id": run_id,
        "steps": total,
        "params": _cpu_params(net) if rank == 0 else None,
    }


def _cpu_params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu().clone() for name, value in net.state_dict().items()}
