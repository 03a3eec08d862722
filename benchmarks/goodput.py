"""Goodput benchmark: 4 ranks train while a random rank is SIGKILLed every few seconds.

Prints one JSON line. The same data-parallel training (4 CPU ranks, gloo, a
model of ``--state-mb`` of weights and Adam state, memory snapshots every
``--memory-every`` steps) runs:

- ``uninterrupted`` (the baseline, in the same invocation): for ``--minutes``;
  it trains N steps at a rate of N / T0;
- ``heal`` (``@distributed(heal=True)``) and/or ``restart`` (today's path: every
  rank restarted, restoring from memory): the same N steps while a thread of this
  process SIGKILLs a random rank every ``--kill-every`` seconds (the ranks say
  their pids in files), at whatever point the rank is at.

Figures per faulted run: ``goodput`` = N / (its wall time x the uninterrupted
rate) (goal >= 0.98 with ``heal``), ``kills``, ``restarts`` (launch events),
``steps_trained_again`` (steps run beyond N) and ``equal`` (the final weights are
bit-identical to the uninterrupted run's).

    python benchmarks/goodput.py [--minutes 20] [--kill-every 120] [--heal | --no-heal]
        [--state-mb 64] [--memory-every 10] [--seed 0]

Without ``--heal`` or ``--no-heal`` both faulted runs are made.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

warnings.filterwarnings("ignore")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))

from nbtools import distributed, events  # noqa: E402

_WIDTH = 512


def _train(cfg: dict) -> dict:
    """One rank: restore, train to ``cfg["steps"]`` (or for ``cfg["seconds"]``), log steps."""
    import torch
    import torch.distributed as dist

    from nbtools.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(cfg["work"], f"pid-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    layers = max(1, round(cfg["state_mb"] * 2**20 / (12 * _WIDTH * _WIDTH)))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *[torch.nn.Linear(_WIDTH, _WIDTH, bias=False) for _ in range(layers)]
        )
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    began = time.time()
    log = open(os.path.join(cfg["work"], "steps-rank0"), "a") if rank == 0 else None
    with CheckpointManager(
        cfg["root"], memory_every=cfg["memory_every"], save_on_close=False
    ) as ckpt:
        step = ckpt.restore(model=model, optimizer=opt)
        stop = torch.zeros(1)
        while True:
            if cfg["steps"] is not None and step >= cfg["steps"]:
                break
            gen = torch.Generator().manual_seed(step * world + rank)
            loss = model(torch.randn(8, _WIDTH, generator=gen)).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            ckpt.maybe_save(step, model=model, optimizer=opt)
            if log is not None:
                log.write(f"{step}\n")
                log.flush()
            step += 1
            if cfg["steps"] is None:
                stop.fill_(float(time.time() - began > cfg["seconds"]))
                dist.all_reduce(stop)
                if stop.item():
                    break
    if log is not None:
        log.close()
    return {"steps": step, "weights": [p.detach().clone() for p in model.parameters()]}


def _killer(work: str, every: float, seed: int, done: threading.Event, kills: list) -> None:
    rng = random.Random(seed)
    while not done.wait(every):
        rank = rng.randrange(4)
        try:
            with open(os.path.join(work, f"pid-{rank}")) as fh:
                pid = int(fh.read())
            os.kill(pid, signal.SIGKILL)
            kills.append((time.time(), rank))
        except (OSError, ValueError):
            pass


def _run(name: str, cfg: dict, heal: bool | None, every: float, seed: int) -> dict:
    work = os.path.join(cfg["base"], name)
    os.makedirs(work)
    run = {**cfg, "work": work, "root": os.path.join(work, "ckpt")}
    faulted = heal is not None
    job = distributed(
        processes=4, max_restarts=10_000 if faulted else 0, output="none", heal=bool(heal)
    )(_train)
    done, kills = threading.Event(), []
    killer = threading.Thread(target=_killer, args=(work, every, seed, done, kills), daemon=True)
    since = time.time()
    if faulted:
        killer.start()
    try:
        results = job.distributed(run)
    finally:
        done.set()
        if faulted:
            killer.join()
    wall = time.time() - since
    with open(os.path.join(work, "steps-rank0")) as fh:
        ran = len(fh.readlines())
    return {
        "wall_s": round(wall, 2),
        "steps": results[0]["steps"],
        "kills": len(kills),
        "restarts": len(events.log(since=since, kinds=["restart"])),
        "heals": len(events.log(since=since, kinds=["healed"])),
        "ran_on_rank0": ran,
        "weights": results[0]["weights"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--kill-every", type=float, default=120.0)
    parser.add_argument("--heal", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--state-mb", type=int, default=64)
    parser.add_argument("--memory-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    base = tempfile.mkdtemp(prefix="nbtools-bench-goodput-")
    shm = tempfile.mkdtemp(prefix="nbtools-bench-goodput-", dir="/dev/shm")
    os.environ["NBTOOLS_SNAPSHOT_DIR"] = shm
    cfg = {
        "base": base,
        "state_mb": args.state_mb,
        "memory_every": args.memory_every,
        "steps": None,
        "seconds": args.minutes * 60,
    }
    result: dict = {"ranks": 4, "minutes": args.minutes, "kill_every_s": args.kill_every}
    try:
        plain = _run("uninterrupted", cfg, None, args.kill_every, args.seed)
        steps = plain["steps"]
        rate = steps / plain["wall_s"]
        result["uninterrupted"] = {"steps": steps, "wall_s": plain["wall_s"]}
        modes = [args.heal] if args.heal is not None else [True, False]
        for heal in modes:
            name = "heal" if heal else "restart"
            got = _run(name, {**cfg, "steps": steps}, heal, args.kill_every, args.seed)
            result[name] = {
                "goodput": round(steps / (got["wall_s"] * rate), 3),
                "wall_s": got["wall_s"],
                "kills": got["kills"],
                "restarts": got["restarts"],
                "heals": got["heals"],
                "steps_trained_again": got["ran_on_rank0"] - steps,
                "equal": all(
                    torch.equal(a, b) for a, b in zip(plain["weights"], got["weights"], strict=True)
                ),
            }
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
