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

Through the launch backend (``backend_4-3-4``, ``backend_8-5-8``): the same
epoch (at most 240 files, global batch 12) trained by one
``@distributed(processes=W, min_processes=W-L)`` call. The ranks on the last L
slots are SIGKILLed at step 4 and their slots cannot start (a new process there
ends while it unpickles its function) until rank 0 reopens them at step 6; each
step at the smaller size takes 0.3 s. Figures: the ledger (``duplicates``,
``drops``), ``step_sizes`` (the epoch's last step holds ``files % 12``),
``steps_per_world``, ``restored_tiers`` (``live``: the survivors' state, so
``volume_bytes_read`` is 0: no rank opened the volume), the ``shrunk`` and
``grew`` lines, and ``kill_to_next_step_s`` (the kill to the first step completed
at the smaller size, two failed starts of each lost slot included) against
``volume_restart_to_first_step_s``, measured in the same run: the same ranks
stopped at the kill's step with a volume checkpoint, and a new launch at the
smaller size that restores it (its memory snapshots were taken by another world
size) and completes its first step (``ratio``; goal <= 0.3).

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


# --- through the launch backend: a lost slot shrinks the group, its return grows it back ------


class _Ids(torch.utils.data.IterableDataset):
    """The file ids of a VolumeDataset (defined here so that the ranks unpickle it by value)."""

    def __init__(self, files: VolumeDataset) -> None:
        self.files = files

    def __iter__(self):
        for path in self.files:
            yield int(os.path.basename(path)[1:6])


def _gate(path: str, slots: list[int]) -> _Gate:
    # A new process on a broken slot ends while it unpickles its function: the slot is lost.
    generation = os.environ.get("NBTOOLS_HEAL_GENERATION", "0")
    if generation != "0" and int(os.environ.get("RANK", -1)) in slots and os.path.exists(path):
        os._exit(3)
    return _Gate(path, slots)


class _Gate:
    def __init__(self, path: str, slots: list[int]) -> None:
        self.path, self.slots = path, slots

    def __reduce__(self):
        return (_gate, (self.path, self.slots))


def _elastic_rank(base: str, tag: str, gate: _Gate, plan: dict) -> dict:
    """One rank of a backend run: train over the epoch, kill the lost ranks at ``plan["kill"]``,
    open the gate at ``plan["back"]``; log each step's ids, world size and end time."""
    import signal

    import torch.distributed as dist

    from nbtools.checkpoint import CheckpointManager
    from nbtools.runtime import get_restart_count

    rank, world, attempt = dist.get_rank(), dist.get_world_size(), get_restart_count()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    files = VolumeDataset(f"{base}/src", cache_dir=f"{base}/cache-{tag}", shuffle=True, seed=SEED)
    batch = plan["batch"]
    with (
        DataLoader(_Ids(files), global_batch_size=batch, num_workers=0) as loader,
        CheckpointManager(f"{base}/ckpt-{tag}", memory_every=4, save_on_close=False) as ckpt,
    ):
        step = ckpt.restore(model=model, optimizer=opt, data=loader)
        tiers = {ckpt.restored_tier}
        for ids in loader:
            if attempt == 0 and step == plan["kill"] and rank in gate.slots:
                with open(f"{base}/{tag}-killed", "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            i = ids.to(torch.float64).unsqueeze(-1)
            x = torch.sin(i * torch.arange(1, 7, dtype=torch.float64) * 0.37)
            loss = ((model(x).squeeze(-1) - torch.cos(i.squeeze(-1) * 0.11)) ** 2).sum() / batch
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            with open(f"{base}/{tag}-ids-{rank}-{os.getpid()}.jsonl", "a") as fh:
                fh.write(json.dumps([step, ids.tolist(), world, time.time()]) + "\n")
            if world < plan["world"]:
                if rank == 0 and step == plan["back"] and os.path.exists(gate.path):
                    os.unlink(gate.path)  # the slots work again
                time.sleep(plan["step_s"])  # the time a real step takes
            if plan.get("stop") is not None and step == plan["stop"]:
                ckpt.save(step, model=model, optimizer=opt, data=loader)
                ckpt.wait()
                break
            ckpt.maybe_save(step, model=model, optimizer=opt, data=loader)
            step += 1
        tiers.add(ckpt.restored_tier)
    return {
        "tiers": sorted(str(t) for t in tiers),
        "params": [p.detach() for p in model.parameters()],
    }


def _warm() -> None:
    """Nothing: a first launch, so that the forkserver is up."""


def _read_log(base: Path, tag: str) -> dict[int, list]:
    steps: dict[int, list] = {}
    for name in os.listdir(base):
        if name.startswith(f"{tag}-ids-"):
            for line in (base / name).read_text().splitlines():
                step, ids, world, when = json.loads(line)
                steps.setdefault(step, []).append((ids, world, when))
    return steps


def _backend_case(root: Path, files: int, batch: int, world: int, lost: list[int]) -> dict:
    """``world`` -> ``world - len(lost)`` -> ``world`` through ``@distributed(min_processes=)``,
    and, in the same run, a restart from the volume at the smaller size."""
    from nbtools import distributed, events

    base = root / f"backend-{world}"
    base.mkdir()
    os.symlink(root / "src", base / "src")
    gate = _Gate(str(base / "broken"), lost)
    (base / "broken").touch()
    plan = {"batch": batch, "world": world, "kill": 4, "back": 6, "step_s": 0.3}
    since = time.time()
    job = distributed(
        processes=world, min_processes=world - len(lost), max_restarts=4, output="none"
    )(_elastic_rank)
    began = time.perf_counter()
    results = job.distributed(str(base), "run", gate, plan)
    wall = time.perf_counter() - began
    steps = _read_log(base, "run")
    killed = float((base / "run-killed").read_text())
    small = [min(w for _, _, w in v) for s, v in sorted(steps.items()) if v[0][1] < world]
    ids = [i for v in steps.values() for part, _, _ in v for i in part]
    sizes = sorted({sum(len(part) for part, _, _ in v) for s, v in steps.items()})
    # The baseline: the same ranks stopped at the kill's step with a volume checkpoint, then a
    # new launch at the smaller size restores it and trains its first step.
    (base / "broken").touch()
    pre = dict(plan, stop=plan["kill"] - 1, world=0)
    distributed(processes=world, output="none")(_elastic_rank).distributed(
        str(base), "vol", _Gate(str(base / "none"), []), pre
    )
    restart_began = time.time()
    rest = distributed(processes=world - len(lost), output="none")(_elastic_rank).distributed(
        str(base),
        "vol",
        _Gate(str(base / "none"), []),
        dict(plan, kill=-1, world=0, stop=plan["kill"]),
    )
    vol_steps = _read_log(base, "vol")
    after = [min(w for _, _, w in vol_steps[s]) for s in sorted(vol_steps) if s >= plan["kill"]]
    to_next_s = small[0] - killed
    restart_s = after[0] - restart_began
    return {
        "world_sizes": [world, world - len(lost), world],
        "steps_per_world": {
            str(w): sum(1 for v in steps.values() if v[0][1] == w)
            for w in (world, world - len(lost))
        },
        **ledger(ids, files),
        "step_sizes": sizes,
        "global_batch": batch,
        "restored_tiers": sorted({t for r in results for t in r["tiers"]}),
        "volume_bytes_read": 0 if "volume" not in str([r["tiers"] for r in results]) else None,
        "shrunk": [e.message for e in events.log(since=since, kinds=["shrunk"])],
        "grew": [e.message for e in events.log(since=since, kinds=["grew"])],
        "kill_to_next_step_s": round(to_next_s, 3),
        "volume_restart_to_first_step_s": round(restart_s, 3),
        "ratio": round(to_next_s / restart_s, 3),
        "restart_tiers": sorted({t for r in rest for t in r["tiers"]}),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="200 files")
    parser.add_argument(
        "--backend-only", action="store_true", help="only the cases through the launch backend"
    )
    args = parser.parse_args()
    files = 200 if args.quick else args.files
    work = Path(tempfile.mkdtemp(prefix="nbtools-bench-elastic-"))
    try:
        make_tree(work / "src", files)
        out: dict[str, Any] = {"benchmark": "elastic"}
        if not args.backend_only:
            out["4-3-4"] = _case(work, files, 64 if files >= 640 else 13, (4, 3, 4))
            out["8-5-8"] = _case(work, files, 61 if files >= 610 else 21, (8, 5, 8))
        # Through the launch backend: kill at step 4, the slots back from step 6; 240 samples.
        # A first call starts the forkserver: the cases then start their ranks as a notebook's
        # later calls do.
        from nbtools import distributed

        distributed(processes=2, output="none")(_warm).distributed()
        from nbtools.launch._local import _forkserver

        deadline = time.monotonic() + 120
        while not _forkserver.ready() and time.monotonic() < deadline:
            time.sleep(0.1)  # its preloads imported, as in a notebook some calls later
        backend_files = min(files, 240)
        sub = work / "backend"
        sub.mkdir()
        make_tree(sub / "src", backend_files)
        out["backend_4-3-4"] = _backend_case(sub, backend_files, 12, 4, [3])
        out["backend_8-5-8"] = _backend_case(sub, backend_files, 12, 8, [5, 6, 7])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
