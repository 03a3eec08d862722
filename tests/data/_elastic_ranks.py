"""A data-parallel run over a VolumeDataset with a fixed global batch, launched at any world size.

Each launch (:func:`launch`) starts ``world`` real gloo ranks (forked processes),
trains a float64 linear model with DDP for some steps of
``DataLoader(global_batch_size=)``, and carries the model and the loader's state
to the next launch through files, as a job that shrinks or grows does through
its checkpoint. Every rank writes the sample ids of each step; rank 0 the
gradient DDP gave each step. :func:`reference` trains the same model in one
process on the same global batches; :func:`ledger` counts duplicates and drops.
Used by the tests and by ``benchmarks/elastic.py``.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _data_helpers import index_of, make_tree
from torch.utils.data import IterableDataset

from nbtools.checkpoint import CheckpointManager
from nbtools.data import DataLoader, VolumeDataset

__all__ = ["FEATURES", "launch", "ledger", "make_tree", "reference"]

FEATURES = 6
LR = 0.05
SEED = 5


class Samples(IterableDataset):
    """The file ids of a VolumeDataset, one sample per cached path (read as it arrives)."""

    def __init__(self, files: VolumeDataset) -> None:
        self.files = files

    def __iter__(self):
        for path in self.files:
            with open(path, "rb") as fh:
                fh.read()
            yield index_of(path)


def features(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of samples ``ids`` (float64, a function of the id alone)."""
    i = ids.to(torch.float64).unsqueeze(-1)
    x = torch.sin(i * torch.arange(1, FEATURES + 1, dtype=torch.float64) * 0.37)
    return x, torch.cos(i.squeeze(-1) * 0.11)


def new_model() -> torch.nn.Linear:
    """The model every run starts from."""
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1, dtype=torch.float64)


def _rank(
    rank: int,
    root_str: str,
    world: int,
    workers: int,
    steps: int | None,
    tag: str,
    global_batch: int | None,
    batch_size: int,
    checkpoint: bool,
) -> None:
    root = Path(root_str)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store-{tag}", rank=rank, world_size=world
    )
    out: dict[str, Any] = {"steps": [], "grads": [], "losses": []}
    try:
        model = new_model()
        files = VolumeDataset(root / "src", cache_dir=root / "cache", shuffle=True, seed=SEED)
        sizing = (
            {"global_batch_size": global_batch}
            if global_batch is not None
            else {"batch_size": batch_size}
        )
        with DataLoader(Samples(files), num_workers=workers, **sizing) as loader:
            if checkpoint:
                with CheckpointManager(root / "ckpt", async_save=False, save_on_close=False) as ck:
                    first = ck.restore(model=model, data=loader)
                    _train(rank, model, loader, steps, global_batch is not None, out)
                    ck.save(first + len(out["steps"]) - 1, model=model, data=loader)
            else:
                if (root / "params.pt").exists():
                    model.load_state_dict(torch.load(root / "params.pt"))
                    loader.load_state_dict(json.loads((root / "loader.json").read_text()))
                _train(rank, model, loader, steps, global_batch is not None, out)
            state = loader.state_dict()
        if rank == 0:
            torch.save(model.state_dict(), root / "params.pt")
            (root / "loader.json").write_text(json.dumps(state))
    finally:
        dist.destroy_process_group()
    (root / f"{tag}-{rank}.json").write_text(json.dumps(out))


def _train(
    rank: int,
    model: torch.nn.Module,
    loader: DataLoader,
    steps: int | None,
    ddp: bool,
    out: dict[str, Any],
) -> None:
    """SGD on the loss scaled by ``loader.loss_scale``; what each step took goes to ``out``."""
    # Without a global batch the ranks may get different numbers of batches near the end
    # of a resumed epoch, where DDP would wait forever: each rank then trains alone.
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for ids in loader:
        x, y = features(ids)
        per_sample = (net(x).squeeze(-1) - y) ** 2
        (per_sample.sum() * loader.loss_scale).backward()
        out["steps"].append(ids.tolist())
        if rank == 0:
            out["grads"].append([p.grad.flatten().tolist() for p in model.parameters()])
        out["losses"].append(per_sample.sum().item())
        opt.step()
        opt.zero_grad()
        if steps is not None and len(out["steps"]) == steps:
            break


def launch(
    root: Path,
    world: int,
    workers: int,
    steps: int | None,
    global_batch: int | None,
    tag: str,
    batch_size: int = 1,
    checkpoint: bool = False,
) -> list[dict[str, Any]]:
    """One launch of ``world`` ranks for ``steps`` steps (None: to the end of the epoch).

    ``global_batch=None``: each rank takes ``batch_size`` samples a step instead
    (the global batch then follows the world size), and trains without DDP.
    ``checkpoint``: the model and the loader's position go from launch to launch
    through a ``CheckpointManager`` under ``root / "ckpt"`` (saved at the
    launch's last step, restored at the next world size), else through files.
    Returns each rank's record:
    ``steps`` (the ids of each step), ``grads`` (rank 0: the gradient of each
    step), ``losses``.
    """
    mp.start_processes(
        _rank,
        args=(str(root), world, workers, steps, tag, global_batch, batch_size, checkpoint),
        nprocs=world,
        start_method="fork",
        join=True,
    )
    return [json.loads((root / f"{tag}-{r}.json").read_text()) for r in range(world)]


def global_steps(ranks: list[dict[str, Any]]) -> list[list[int]]:
    """The ids of each global step, all ranks together."""
    return [sum(parts, []) for parts in zip(*(r["steps"] for r in ranks), strict=True)]


def ledger(ids: list[int], num_files: int) -> dict[str, int]:
    """``duplicates`` (samples seen more than once, counted per extra time) and ``drops``."""
    counts = collections.Counter(ids)
    return {
        "duplicates": sum(c - 1 for c in counts.values()),
        "drops": num_files - len(set(ids) & set(range(num_files))),
    }


def reference(steps: list[list[int]]) -> tuple[list[list[list[float]]], torch.nn.Linear]:
    """One process, the same global batches: each step's gradient of the mean loss, and the
    model after them."""
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for ids in steps:
        x, y = features(torch.tensor(ids))
        ((model(x).squeeze(-1) - y) ** 2).mean().backward()  # the mean over the global batch
        grads.append([p.grad.flatten().tolist() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads, model
