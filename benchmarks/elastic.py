"""A fixed global batch through a shrink and a grow: 4 -> 3 -> 4 and 8 -> 5 -> 8 CPU ranks.

Prints one JSON line. Each case trains a float64 linear model with DDP on real
gloo ranks over a ``VolumeDataset`` of ``--files`` files, one sample per file,
with ``DataLoader(global_batch_size=G)``. A job that loses ranks and later gets
them back is three separate launches here (the world sizes of the case), with
the model and the loader's state carried across in files, as the next attempt
of a shrinking or growing job carries them in its checkpoint; the second launch
starts mid-epoch, the third finishes the epoch. The helpers are those of the
tests (``tests/data/_elastic_ranks.py``).

Figures per case:

- ``duplicates``/``drops``: the sample ledger of the epoch over the three
  launches (goal: 0 and 0);
- ``step_sizes``: the distinct sizes of the global steps but the epoch's last
  (goal: only ``G``), ``last_step`` the samples of that last step (``files % G``),
  ``shares``: each launch's samples per rank;
- ``same_batches_as_one_process``: every global step holds the same samples as
  the same step of one uninterrupted process (world size 1);
- ``grad_max_rel_diff``: the largest relative difference between a step's DDP
  gradient and one process's gradient of the mean loss over the same global
  batch; ``params_max_abs_diff`` the final parameters against that process's,
  and ``params_max_abs_diff_vs_uninterrupted`` against an uninterrupted DDP run
  at the case's first world size (the baseline, measured in the same run);
  ``loss_max_rel_diff`` the largest relative difference between the two runs'
  per-step mean losses (the curves overlap when it is near 0). The model is
  float64 and only the order of additions differs, so all of these stay near
  1e-15;
- ``launch_s``: each launch's wall time.

Baseline ``per_rank_batch``: the same three launches with today's
``batch_size=G // world`` of the first world size kept per rank (each rank
reading alone, no DDP): the global batch follows the world size (``step_sizes``
lists them), so the learning-rate schedule and the gradient's scale change with
every shrink, and ``steps_per_rank`` shows the launches where ranks get
different numbers of batches, on which DDP would wait forever.

Run: ``python benchmarks/elastic.py`` (``--files``, ``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests", "data"))
import torch  # noqa: E402
from _elastic_ranks import (  # noqa: E402
    SEED,
    Samples,
    global_steps,
    launch,
    ledger,
    make_tree,
    reference,
)

from nbtools.data import DataLoader, VolumeDataset  # noqa: E402
from nbtools.runtime import batch_plan  # noqa: E402


def _one_process_steps(root: Path, global_batch: int) -> list[list[int]]:
    files = VolumeDataset(root / "src", cache_dir=root / "cache", shuffle=True, seed=SEED)
    with DataLoader(Samples(files), global_batch_size=global_batch, num_workers=0) as loader:
        return [b.tolist() for b in loader]


def _fresh(root: Path) -> None:
    for name in os.listdir(root):
        if name not in ("src", "cache"):
            path = root / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _phases(
    root: Path, phases: list[tuple[int, int, int | None]], global_batch: int | None, per_rank: int
) -> tuple[list[list[dict[str, Any]]], list[float]]:
    _fresh(root)
    runs, seconds = [], []
    for i, (world, workers, steps) in enumerate(phases):
        start = time.perf_counter()
        runs.append(launch(root, world, workers, steps, global_batch, f"p{i}", per_rank))
        seconds.append(round(time.perf_counter() - start, 2))
    return runs, seconds


def _losses(runs: list[list[dict[str, Any]]]) -> list[float]:
    """Each global step's mean loss over its samples."""
    out = []
    for ranks in runs:
        for parts, sums in zip(
            zip(*(r["steps"] for r in ranks), strict=True),
            zip(*(r["losses"] for r in ranks), strict=True),
            strict=True,
        ):
            out.append(sum(sums) / sum(len(p) for p in parts))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max())


def _case(root: Path, files: int, global_batch: int, sizes: tuple[int, int, int]) -> dict:
    first, middle, last = sizes
    whole = files // global_batch
    phases = [(first, 1, whole // 3), (middle, 2, whole // 3), (last, 0, None)]
    runs, seconds = _phases(root, phases, global_batch, 1)
    elastic_params = torch.load(root / "params.pt")
    steps = [s for ranks in runs for s in global_steps(ranks)]
    ids = [i for s in steps for i in s]
    grads, model = reference(steps)
    got = [g for ranks in runs for g in ranks[0]["grads"]]
    grad_diff = max(
        _rel(torch.tensor(a), torch.tensor(b))
        for mine, theirs in zip(got, grads, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )
    one = _one_process_steps(root, global_batch)
    # The baseline: one uninterrupted launch at the first world size.
    base_runs, base_seconds = _phases(root, [(first, 1, None)], global_batch, 1)
    base_params = torch.load(root / "params.pt")
    mine_loss, base_loss = torch.tensor(_losses(runs)), torch.tensor(_losses(base_runs))
    # Today's way: a batch size per rank, fixed at the first world size's share.
    per_rank = global_batch // first
    old_runs, _ = _phases(root, phases, None, per_rank)
    old_steps = [
        sum(parts, [])
        for ranks in old_runs
        for parts in itertools.zip_longest(*(r["steps"] for r in ranks), fillvalue=[])
    ]
    return {
        "files": files,
        "global_batch": global_batch,
        "world_sizes": list(sizes),
        "steps": len(steps),
        "shares": [list(batch_plan(global_batch, w, 0).shares) for w in sizes],
        "step_sizes": sorted({len(s) for s in steps[:-1]}),
        "last_step": len(steps[-1]),
        **ledger(ids, files),
        "same_batches_as_one_process": [sorted(s) for s in steps] == [sorted(s) for s in one],
        "grad_max_rel_diff": grad_diff,
        "params_max_abs_diff": max(
            float((elastic_params[k] - v).abs().max()) for k, v in model.state_dict().items()
        ),
        "params_max_abs_diff_vs_uninterrupted": max(
            float((elastic_params[k] - v).abs().max()) for k, v in base_params.items()
        ),
        "loss_max_rel_diff": _rel(mine_loss, base_loss),
        "launch_s": seconds,
        "uninterrupted_launch_s": base_seconds[0],
        "per_rank_batch": {
            "batch_size": per_rank,
            "step_sizes": sorted({len(s) for s in old_steps[:-1]}),
            "steps_per_rank": [[len(r["steps"]) for r in ranks] for ranks in old_runs],
            **ledger([i for s in old_steps for i in s], files),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="200 files")
    args = parser.parse_args()
    files = 200 if args.quick else args.files
    work = Path(tempfile.mkdtemp(prefix="nbtools-bench-elastic-"))
    try:
        make_tree(work / "src", files)
        out = {
            "benchmark": "elastic",
            "4-3-4": _case(work, files, 64 if files >= 640 else 13, (4, 3, 4)),
            "8-5-8": _case(work, files, 61 if files >= 610 else 21, (8, 5, 8)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
