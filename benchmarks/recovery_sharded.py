"""Recovery benchmark for sharded state: FSDP2 ranks, one SIGKILLed, from memory vs the volume.

Prints one JSON line. Two launches of the same training run on 4 CPU ranks
(``@distributed(processes=4, max_restarts=1)``, gloo), a stack of
``1024 x 1024`` linear layers sharded with FSDP2 (``fully_shard`` on each layer
and on the model, one mesh over the 4 ranks) and trained with Adam, each rank
holding ``--state-mb`` of local shards (parameters and the two moments). The
model is built on the meta device, as models too large for one rank are:
``restore`` gives it storage, then loads into it or initialises it. Volume
checkpoints go every ``--every`` steps to an S3-compatible server on loopback
(moto behind ``benchmarks/_capped_s3.py``) capped at ``--mbps``, which counts
the object bytes it serves. One rank, drawn with ``--seed``, SIGKILLs itself at
a step drawn with ``--seed`` between ``--memory-every + 1`` and ``--kill-by``;
the launcher restarts the group and ``CheckpointManager.restore`` loads the
state.

- ``memory``: ``CheckpointManager(every=200, memory_every=10)``;
- ``volume`` (today's path, the baseline): ``CheckpointManager(every=200)``.

Figures:

- ``kill_to_next_step_s``: from the kill to the next completed step (rank 0,
  every rank past the step's all-reduce); ``kill_to_next_step_x`` = memory /
  volume (goal <= 0.3); ``restore_s`` the restore alone;
- ``timeline_s``: from the kill to each mark of rank 0's restarted attempt: the
  training function running (``function``: the launcher's part), the model built on
  the meta device and sharded with its optimizer (``model_built``), the manager made
  (``manager_opened``), ``restored`` (every rank past the restore) and ``next_step``;
- ``steps_trained_again``: the steps between the restored step and the kill
  (goal for memory: <= ``memory_every``);
- ``volume_bytes_read_on_restore``: checkpoint bytes (objects inside
  ``step_<N>``) the server sent from the kill to the end of the restarted run,
  which saves nothing to the volume (goal for memory: 0);
- ``blocked_per_snapshot_s``: median time ``maybe_save`` blocks training at a
  snapshot-only step plus how much longer than a usual one the optimizer step
  after it takes (it waits there for the copy that runs behind the forward and
  backward passes), over ``plain_copy_s``, the median of copying the rank's
  local shards into preallocated tensors at steps between the snapshots of the
  same run (``blocked_over_copy``, goal <= 1.5x).

    python benchmarks/recovery_sharded.py [--state-mb 252] [--every 200]
        [--memory-every 10] [--kill-by 40] [--mbps 100] [--seed 0] [--local]

``--kill-by`` bounds the kill step (a full run draws it up to ``every``; a
smaller bound keeps the run short and favours the volume, which then trains
fewer steps again). ``--local`` puts the volume in a local directory instead of
the capped server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(_HERE, "..", "tests", "checkpoint")
sys.path.insert(0, _TESTS)
from _restore_servers import s3_env, s3_server  # noqa: E402

from nbtools import distributed  # noqa: E402

BUCKET = "bench"
_WIDTH = 1024
_RANKS = 4
_AFTER = 3  # steps trained after the recovery's first one


def _served(cfg: dict) -> int:
    """Checkpoint bytes (objects inside ``step_<N>``) the volume's server has sent."""
    if not cfg["endpoint"]:
        return 0
    sys.path.insert(0, cfg["tests"])
    from _restore_servers import s3_served

    return s3_served(cfg["endpoint"], checkpoints=True)


def _local_shards(model, opt) -> list:
    """This rank's local shards of the parameters and of the optimizer's state tensors."""
    local = [p.to_local() for p in model.parameters()]
    for state in opt.state.values():
        local += [t.to_local() if hasattr(t, "to_local") else t for t in state.values() if t.dim()]
    return local


def _train(cfg: dict) -> dict:
    """One rank's run; rank 0's dict carries the figures of the restarted attempt."""
    import signal

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nbtools.checkpoint import CheckpointManager
    from nbtools.runtime import get_restart_count

    marks = {"function": time.time()}
    torch.set_num_threads(1)
    rank, world, attempt = dist.get_rank(), dist.get_world_size(), get_restart_count()
    every, memory_every, kill_at = cfg["every"], cfg["memory_every"], cfg["kill_at"]
    # 12 bytes of local state per weight (float32 weight and Adam's two moments).
    layers = max(1, round(world * cfg["state_mb"] * 2**20 / (12 * _WIDTH * _WIDTH)))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *[torch.nn.Linear(_WIDTH, _WIDTH, bias=False) for _ in range(layers)]
        )
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    marks["model_built"] = time.time()
    ckpt = CheckpointManager(
        cfg["root"],
        every=every,
        memory_every=memory_every,
        staging_dir=os.path.join(cfg["work"], f"staging-{rank}"),
        save_on_close=False,
    )
    marks["manager_opened"] = time.time()
    began = time.perf_counter()
    start = ckpt.restore(model=model, optimizer=opt)
    dist.barrier()
    restore_s = time.perf_counter() - began
    marks["restored"] = time.time()
    end = kill_at + 1 if attempt == 0 else start + 1 + _AFTER
    done: list[float] = []
    blocked: list[float] = []
    after: list[float] = []  # optimizer steps right after a snapshot-only step
    steps: list[float] = []  # the other optimizer steps
    copies: list[float] = []
    flag = torch.zeros(1)
    local: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    for step in range(start, end):
        torch.manual_seed(1000 * step + rank)  # each data-parallel rank its batch
        loss = model(torch.randn(8, _WIDTH)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t = time.perf_counter()
        opt.step()  # waits for a snapshot's copy still in flight
        last = step - 1
        snapped = bool(memory_every) and last % memory_every == 0 and last % every and last >= start
        (after if snapped else steps).append(time.perf_counter() - t)
        t = time.perf_counter()
        ckpt.maybe_save(step, model=model, optimizer=opt)
        if memory_every and step % memory_every == 0 and step % every:
            blocked.append(time.perf_counter() - t)
        if step % 10 == 5 and step > start:
            # The floor of any snapshot: copying this rank's local shards (parameters and
            # optimizer state) into preallocated tensors, timed between snapshots.
            if not local:
                local = _local_shards(model, opt)
                buffers = [torch.empty_like(t) for t in local]
            t = time.perf_counter()
            for b, src in zip(buffers, local, strict=True):
                b.copy_(src)
            copies.append(time.perf_counter() - t)
        dist.all_reduce(flag)
        done.append(time.time())
        if attempt == 0 and step == kill_at:
            if rank == 0:
                with open(cfg["first"], "w") as fh:
                    json.dump(
                        {"blocked": blocked, "after": after, "steps": steps, "copies": copies}, fh
                    )
            dist.barrier()
            if rank == cfg["kill_rank"]:
                before = _served(cfg)  # asked before the kill: no request on the way back
                with open(cfg["killed"], "w") as fh:
                    json.dump({"at": time.time(), "served": before}, fh)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(flag)  # the killed rank never joins: the group fails
    state_bytes = sum(t.numel() * t.element_size() for t in _local_shards(model, opt))
    ckpt.close()
    served = _served(cfg) if rank == 0 else 0
    return {
        "restored_step": ckpt.restored_step,
        "tier": ckpt.restored_tier,
        "restore_s": restore_s,
        "served": served,
        "first_done": done[0],
        "marks": marks,
        "state_mb": state_bytes / 2**20,
    }


def _launch(cfg: dict) -> dict:
    job = distributed(processes=_RANKS, max_restarts=1, output="none")(_train)
    result = job.distributed(cfg)[0]
    with open(cfg["first"]) as fh:
        first = json.load(fh)
    with open(cfg["killed"]) as fh:
        kill = json.load(fh)
    figures = {
        "restored_step": result["restored_step"],
        "tier": result["tier"],
        "kill_to_next_step_s": round(result["first_done"] - kill["at"], 2),
        "restore_s": round(result["restore_s"], 2),
        "timeline_s": {
            name: round(at - kill["at"], 2)
            for name, at in {**result["marks"], "next_step": result["first_done"]}.items()
        },
        "steps_trained_again": cfg["kill_at"] - (result["restored_step"] or 0),
        "volume_bytes_read_on_restore": result["served"] - kill["served"],
        "state_mb_per_rank": round(result["state_mb"], 1),
    }
    copy = statistics.median(first["copies"][1:] or first["copies"])
    figures["plain_copy_s"] = round(copy, 4)
    if first["blocked"]:
        in_save = statistics.median(first["blocked"])
        in_step = max(0.0, statistics.median(first["after"]) - statistics.median(first["steps"]))
        figures["blocked_in_save_s"] = round(in_save, 4)
        figures["blocked_in_next_step_s"] = round(in_step, 4)
        figures["blocked_per_snapshot_s"] = round(in_save + in_step, 4)
        figures["blocked_over_copy"] = round((in_save + in_step) / copy, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-mb", type=int, default=252)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--memory-every", type=int, default=10)
    parser.add_argument("--kill-by", type=int, default=40, help="the latest step of the kill")
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local", action="store_true", help="the volume in a local directory")
    args = parser.parse_args()
    if not args.memory_every + 1 <= args.kill_by < args.every:
        parser.error("--kill-by must lie between --memory-every + 1 and --every - 1")
    rng = random.Random(args.seed)
    kill_at = rng.randint(args.memory_every + 1, args.kill_by)
    kill_rank = rng.randrange(_RANKS)
    work = tempfile.mkdtemp(prefix="nbtools-bench-recovery-sharded-")
    shm = tempfile.mkdtemp(prefix="nbtools-bench-recovery-sharded-", dir="/dev/shm")
    os.environ["NBTOOLS_SNAPSHOT_DIR"] = shm
    result: dict = {
        "stack": "fsdp2",
        "ranks": _RANKS,
        "every": args.every,
        "memory_every": args.memory_every,
        "kill_at": kill_at,
        "kill_rank": kill_rank,
        "volume": "local directory" if args.local else f"capped S3 at {args.mbps:g} MB/s",
    }
    try:
        with _null() if args.local else s3_server(args.mbps) as endpoint:
            if endpoint:
                os.environ.update(s3_env(endpoint))
                import s3fs

                fs = s3fs.S3FileSystem()
                fs.mkdir(BUCKET)
            for name, memory_every in (("volume", None), ("memory", args.memory_every)):
                root = os.path.join(work, name) if args.local else f"s3://{BUCKET}/{name}"
                cfg = {
                    "root": root,
                    "work": work,
                    "tests": _TESTS,
                    "endpoint": endpoint,
                    "state_mb": args.state_mb,
                    "every": args.every,
                    "memory_every": memory_every,
                    "kill_at": kill_at,
                    "kill_rank": kill_rank,
                    "first": os.path.join(work, f"{name}-first.json"),
                    "killed": os.path.join(work, f"{name}-killed.json"),
                }
                result[name] = _launch(cfg)
            if endpoint:
                s3fs.S3FileSystem.close_session(fs.loop, fs.s3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    mem, vol = result["memory"], result["volume"]
    result["state_mb_per_rank"] = mem.pop("state_mb_per_rank")
    vol.pop("state_mb_per_rank")
    result["kill_to_next_step_x"] = round(
        mem["kill_to_next_step_s"] / vol["kill_to_next_step_s"], 3
    )
    print(json.dumps(result))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
