"""Recovery benchmark: a rank SIGKILLed mid-run, recovered from memory snapshots vs from the volume.

Prints one JSON line. Two launches of the same training run on 4 CPU ranks
(``@distributed(processes=4, max_restarts=1)``, gloo), each rank holding
``--state-mb`` of model and Adam state (data-parallel replicas: every rank
computes the same update, as DDP does after its all-reduce, and one small
all-reduce per step keeps the ranks in step). Volume checkpoints go every
``--every`` steps to an S3-compatible server on loopback (moto behind
``benchmarks/_capped_s3.py``) capped at ``--mbps``, which counts the object
bytes it serves. One rank, drawn with ``--seed``, SIGKILLs itself at a step
drawn with ``--seed`` between ``--memory-every`` and ``--every``; the launcher
restarts the group and ``CheckpointManager.restore`` loads the state.

- ``memory``: ``CheckpointManager(every=200, memory_every=10)``;
- ``volume`` (today's path, the baseline): ``CheckpointManager(every=200)``.

Figures:

- ``kill_to_next_step_s``: from the kill to the next completed step (rank 0,
  every rank past the step's all-reduce); ``kill_to_next_step_x`` = memory / volume
  (goal <= 0.25); ``restore_s`` the restore alone;
  ``kill_to_rank_started_s`` the part before the restarted rank 0 ran the
  training function (detecting the failure, stopping the survivors, starting
  the new ranks, forming the group), ``kill_to_restore_started_s`` that plus
  building the model and the manager; ``phases_s`` splits the whole into
  ``detect_and_stop_survivors`` (kill to the launcher's ``rank_failed`` event),
  ``start_ranks`` (to the restarted rank 0's process creation, or the
  launcher's ``restart`` event for a process it had started ahead),
  ``form_group`` (to its training function: the group's rendezvous and the
  function's arrival), ``build_model_and_manager``, ``restore`` and
  ``first_step``, and ``dominant_phase`` names the longest;
- ``steps_trained_again``: the steps between the restored step and the kill;
- ``volume_bytes_read_on_restore``: checkpoint bytes (objects inside ``step_<N>``)
  the server sent from the kill to the end of the restarted run, which saves
  nothing to the volume (goal for memory: 0); the counts are asked for by the
  killed rank before its kill and by rank 0 after its last step, so no request
  to the server lies on the timed way back;
- ``blocked_per_snapshot_s``: median time ``maybe_save`` blocks training at a
  snapshot-only step (``blocked_in_save_s``) plus how much longer than a usual
  one the optimizer step after it takes (``blocked_in_next_step_s``: it waits
  there for the part of the copy that runs behind the forward and backward
  passes), over ``plain_copy_s``, the median of copying the same
  state into preallocated tensors at steps between the snapshots of the same
  run (goal <= 1.5x; both launches make these copies);
- ``steps_per_s``: rank 0's rate over the steps before the kill, in each launch;
- ``steps_per_s_x`` (goal >= 0.97x): from ``paired``, a third launch of the same
  4 ranks and state, no kill, that cycles ``--rate-cycles`` times through three
  blocks of ``--memory-every`` steps: nothing more, a memory snapshot at the
  block's first step (``CheckpointManager(memory_every=...)``, no volume saves),
  and a plain copy of the state into preallocated tensors there instead (the
  floor of any snapshot that copies the state). ``x`` is the median over cycles
  of the block with a snapshot's rate over the block with nothing's in the same
  cycle (``plain_copy_x`` the same for the plain copy), so both rates see the
  machine's load of the same seconds (two launches a minute apart differ by
  several percent on a shared machine).

    python benchmarks/recovery.py [--state-mb 256] [--every 200] [--memory-every 10]
        [--mbps 100] [--seed 0] [--rate-cycles 20] [--local] [--random-init] [--heal]

``--heal`` runs two launches instead, with the same kill: ``memory`` (today's
restart of every rank, restoring from the memory snapshots) and ``heal``
(``@distributed(heal=True)``: the survivors keep their processes and the
replacement heals from them). Figures per launch as above, plus
``survivors_kept_pids`` (the ranks not killed have the same process after the
recovery); ``heal_x`` = heal's ``kill_to_next_step_s`` over memory's (goal <= 0.5)
and heal's ``steps_trained_again`` (goal <= 1). A heal's ``phases_s`` split its kill to the next
step into ``detect``, ``start_replacement``, ``replacement_joins``,
``build_model_and_manager``, ``restore`` and ``first_step`` (``_heal_phases``), and
``replacement_was_spare`` says whether the replacement was a spare rank parked before the
kill.

``--local`` puts the volume in a local directory instead of the capped server.
Every attempt of both launches builds the model on the meta device, as training
code for large models does: ``restore`` gives it storage and loads into it, or
initialises it on the first attempt (nothing to restore). ``--random-init``
builds it on the CPU instead, randomly initialised on every attempt (half a
second here) and then overwritten by the restore.
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
sys.path.insert(0, os.path.join(_HERE, "..", "tests", "checkpoint"))
from _restore_servers import s3_env, s3_server  # noqa: E402

from nbtools import distributed  # noqa: E402

BUCKET = "bench"
_WIDTH = 1024
_AFTER = 3  # steps trained after the recovery's first one


def _train(cfg: dict) -> dict:
    """One rank's run; rank 0's dict carries the figures of the restarted attempt."""
    import signal

    import torch
    import torch.distributed as dist

    from nbtools.checkpoint import CheckpointManager
    from nbtools.runtime import get_restart_count

    entered = time.time()
    created = _process_started()
    with open(
        os.path.join(cfg["work"], f"{cfg['name']}-pid-{get_restart_count()}-{_rank()}"), "w"
    ) as fh:
        fh.write(str(os.getpid()))
    torch.set_num_threads(1)
    rank, attempt = dist.get_rank(), get_restart_count()
    every, memory_every, kill_at = cfg["every"], cfg["memory_every"], cfg["kill_at"]
    # Layers of _WIDTH^2 float32 weights, trained with Adam: 12 bytes of state per weight.
    layers = max(1, round(cfg["state_mb"] * 2**20 / (12 * _WIDTH * _WIDTH)))
    torch.manual_seed(0)
    # Built on the meta device: restore() gives it storage and fills it, or initialises it
    # on a fresh start (each Linear's reset_parameters). --random-init: built on the CPU,
    # randomly initialised on every attempt, the restore then overwriting it.
    with torch.device("cpu" if cfg["random_init"] else "meta"):
        model = torch.nn.Sequential(
            *[torch.nn.Linear(_WIDTH, _WIDTH, bias=False) for _ in range(layers)]
        )
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    ckpt = CheckpointManager(
        cfg["root"],
        every=every,
        memory_every=memory_every,
        staging_dir=os.path.join(cfg["work"], f"staging-{rank}"),
        save_on_close=False,
    )
    began, restoring = time.perf_counter(), time.time()
    start = ckpt.restore(model=model, optimizer=opt)
    dist.barrier()
    restore_s, restored_at = time.perf_counter() - began, time.time()
    end = kill_at + 1 if attempt == 0 else start + 1 + _AFTER
    done: list[float] = []
    blocked: list[float] = []
    after: list[float] = []  # optimizer steps right after a snapshot-only step
    steps: list[float] = []  # the other optimizer steps
    copies: list[float] = []
    flag = torch.zeros(1)
    # The floor of any snapshot: copying this state into preallocated tensors, timed
    # between snapshots (both launches do it, so it costs their step rates alike).
    tensors = [p.detach() for p in model.parameters()]
    buffers = [torch.empty_like(t) for t in tensors]
    for step in range(start, end):
        torch.manual_seed(step)
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
            if len(tensors) == layers:  # Adam's state exists from the first step on
                tensors += [t for s in opt.state.values() for t in s.values() if t.dim()]
                buffers += [torch.empty_like(t) for t in tensors[layers:]]
            t = time.perf_counter()
            for b, src in zip(buffers, tensors, strict=True):
                b.copy_(src)
            copies.append(time.perf_counter() - t)
        dist.all_reduce(flag)
        done.append(time.time())
        if attempt == 0 and step == kill_at:
            if rank == 0:
                with open(cfg["first"], "w") as fh:
                    json.dump(
                        {
                            "done": done,
                            "blocked": blocked,
                            "after": after,
                            "steps": steps,
                            "copies": copies,
                        },
                        fh,
                    )
            dist.barrier()
            if rank == cfg["kill_rank"]:
                before = _served(cfg)  # asked before the kill: no request on the way back
                with open(cfg["killed"], "w") as fh:
                    json.dump({"at": time.time(), "served": before}, fh)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(flag)  # the killed rank never joins: the group fails
    tensors = [p.detach() for p in model.parameters()]
    tensors += [t for s in opt.state.values() for t in s.values() if t.dim()]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    ckpt.close()
    # Everything the server sent since the kill: the restarted ranks read nothing else
    # from the volume (no volume checkpoint is due in the steps they train).
    served = _served(cfg) if rank == 0 else 0
    return {
        "attempt": attempt,
        "restored_step": ckpt.restored_step,
        "tier": ckpt.restored_tier,
        "restore_s": restore_s,
        "entered": entered,
        "created": created,
        "restoring": restoring,
        "restored_at": restored_at,
        "served": served,
        "first_done": done[0],
        "state_mb": state_bytes / 2**20,
    }


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _served(cfg: dict) -> int:
    """Checkpoint bytes (objects inside ``step_<N>``) the volume's server has sent."""
    if not cfg["endpoint"]:
        return 0
    sys.path.insert(0, cfg["tests"])
    from _restore_servers import s3_served

    return s3_served(cfg["endpoint"], checkpoints=True)


def _process_started() -> float:
    """When this process was created (forked), in epoch seconds, to the clock tick.

    From ``/proc/self/stat``'s start time against the boot-time clock: ``psutil``'s
    ``create_time`` adds the boot time rounded to the second, too coarse here.
    """
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def _phases(result: dict, killed: float, since: float) -> dict:
    """Where the time from the kill to the next completed step went, phase by phase.

    The launcher's ``rank_failed`` event marks the failure seen and the survivors
    stopped (it is emitted once the attempt's ranks have all ended), its ``restart``
    event the start of the new attempt; the restarted rank 0 reports when its process
    was created, when it entered the training function, when its restore began and ended.
    """
    from nbtools import events

    seen = [e.time for e in events.log(since=since, kinds=["rank_failed"])]
    restart = [e.time for e in events.log(since=since, kinds=["restart"])]
    failed_at = seen[0] if seen else killed
    restart_at = restart[0] if restart else failed_at
    # The launcher may hold rank processes started ahead of need: a process created before
    # the restart counts from the restart.
    started = max(result["created"], restart_at)
    phases = {
        "detect_and_stop_survivors": failed_at - killed,
        "start_ranks": started - failed_at,
        "form_group": result["entered"] - started,
        "build_model_and_manager": result["restoring"] - result["entered"],
        "restore": result["restored_at"] - result["restoring"],
        "first_step": result["first_done"] - result["restored_at"],
    }
    return {k: round(v, 2) for k, v in phases.items()}


def _heal_phases(result: dict, replacement: dict, killed: float, since: float) -> dict:
    """Where a heal's time went, from the kill to the next completed step.

    ``detect``: to the launcher seeing the death (its ``healed`` event says how long
    after that the group restored); ``start_replacement``: to the replacement's process
    creation (0 for a spare: it ran before); ``replacement_joins``: to the replacement
    entering the training function (its imports and unpickling, the survivors leaving
    the old group, the rendezvous of the new generation); then, from rank 0,
    ``build_model_and_manager``, ``restore`` (the live state) and ``first_step``.
    """
    from nbtools import events

    healed = events.log(since=since, kinds=["healed"])
    restored = [e for e in events.log(since=killed, kinds=["checkpoint_restored"])]
    seen = killed
    if healed and restored and healed[0].fields:
        seen = restored[0].time - float(healed[0].fields.get("seconds", 0.0))
    created = max(replacement["created"], seen)
    joined = max(replacement["entered"], created)
    phases = {
        "detect": seen - killed,
        "start_replacement": created - seen,
        "replacement_joins": joined - created,
        "build_model_and_manager": max(0.0, result["restoring"] - joined),
        "restore": result["restored_at"] - result["restoring"],
        "first_step": result["first_done"] - result["restored_at"],
    }
    return {k: round(v, 2) for k, v in phases.items()}


def _rate(cfg: dict) -> dict:
    """One rank of the paired rate run: cycles of three blocks of ``block`` steps each."""
    import torch
    import torch.distributed as dist

    from nbtools.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    block = cfg["memory_every"]
    layers = max(1, round(cfg["state_mb"] * 2**20 / (12 * _WIDTH * _WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(_WIDTH, _WIDTH, bias=False) for _ in range(layers)]
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    # No volume saves: every=None; snapshots only where this loop calls maybe_save.
    ckpt = CheckpointManager(
        os.path.join(cfg["work"], "rate"), memory_every=block, save_on_close=False
    )
    flag = torch.zeros(1)
    control: list[torch.Tensor] = []
    done = []
    for step in range(3 * block * (cfg["cycles"] + 1)):
        torch.manual_seed(step)
        loss = model(torch.randn(8, _WIDTH)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kind = (step // block) % 3 if step % block == 0 else 0
        if kind == 1:
            ckpt.maybe_save(step, model=model, optimizer=opt)
        elif kind == 2:
            tensors = [p.detach() for p in model.parameters()]
            tensors += [t for s in opt.state.values() for t in s.values() if t.dim()]
            control = control or [torch.empty_like(t) for t in tensors]
            for b, src in zip(control, tensors, strict=True):
                b.copy_(src)
        dist.all_reduce(flag)
        done.append(time.time())
    ckpt.close()
    return {"done": done}


def _paired(cfg: dict) -> dict:
    """Step rates with nothing more, a memory snapshot, a plain copy at each block's first
    step, paired block by block (the median over cycles of each cycle's ratio)."""
    block = cfg["memory_every"]
    done = distributed(processes=4, output="none")(_rate).distributed(cfg)[0]["done"]
    spans = [done[i + block - 1] - done[i - 1] for i in range(3 * block, len(done), block)]
    cycles = [spans[i : i + 3] for i in range(0, len(spans) - 2, 3)]
    rate = [len(cycles) * block / sum(c[k] for c in cycles) for k in range(3)]
    return {
        "cycles": len(cycles),
        "steps_per_s_without": round(rate[0], 3),
        "steps_per_s_with_snapshots": round(rate[1], 3),
        "steps_per_s_with_plain_copies": round(rate[2], 3),
        "x": round(statistics.median(c[0] / c[1] for c in cycles), 3),
        "plain_copy_x": round(statistics.median(c[0] / c[2] for c in cycles), 3),
    }


def _launch(cfg: dict) -> dict:
    job = distributed(processes=4, max_restarts=1, output="none", heal=cfg["heal"])(_train)
    since = time.time()
    results = job.distributed(cfg)
    result = results[0]
    with open(cfg["first"]) as fh:
        first = json.load(fh)
    with open(cfg["killed"]) as fh:
        kill = json.load(fh)
    killed = kill["at"]
    done = first["done"][1:]  # past step 0 (its volume save)
    figures = {
        "restored_step": result["restored_step"],
        "tier": result["tier"],
        "kill_to_next_step_s": round(result["first_done"] - killed, 2),
        "kill_to_rank_started_s": round(result["entered"] - killed, 2),
        "kill_to_restore_started_s": round(result["restoring"] - killed, 2),
        "restore_s": round(result["restore_s"], 2),
        "steps_trained_again": cfg["kill_at"] - result["restored_step"],
        "volume_bytes_read_on_restore": result["served"] - kill["served"],
        "steps_per_s": round((len(done) - 1) / (done[-1] - done[0]), 3),
        "state_mb_per_rank": round(result["state_mb"], 1),
    }
    pids = {
        attempt: [
            _read(os.path.join(cfg["work"], f"{cfg['name']}-pid-{attempt}-{r}")) for r in range(4)
        ]
        for attempt in (0, 1)
    }
    survivors = [r for r in range(4) if r != cfg["kill_rank"]]
    figures["survivors_kept_pids"] = all(pids[0][r] == pids[1][r] for r in survivors)
    if cfg["heal"]:
        replacement = results[cfg["kill_rank"]]
        phases = _heal_phases(result, replacement, killed, since)
        # Whether the replacement's process ran before the kill (a spare parked ahead of need).
        figures["replacement_was_spare"] = replacement["created"] < killed
    else:
        phases = _phases(result, killed, since)
    figures["phases_s"] = phases
    figures["dominant_phase"] = max(phases, key=lambda k: phases[k])
    copy = statistics.median(first["copies"][1:])  # past the first (it faults the pages in)
    figures["plain_copy_s"] = round(copy, 4)
    if first["blocked"]:
        # Blocked in maybe_save, plus what the next optimizer step took over a usual one
        # (it waits there for the part of the copy that runs behind training).
        in_save = statistics.median(first["blocked"])
        in_step = max(0.0, statistics.median(first["after"]) - statistics.median(first["steps"]))
        figures["blocked_in_save_s"] = round(in_save, 4)
        figures["blocked_in_next_step_s"] = round(in_step, 4)
        figures["blocked_per_snapshot_s"] = round(in_save + in_step, 4)
        figures["blocked_over_copy"] = round((in_save + in_step) / copy, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-mb", type=int, default=256)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--memory-every", type=int, default=10)
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-cycles", type=int, default=20, help="cycles of the paired rate run")
    parser.add_argument("--local", action="store_true", help="the volume in a local directory")
    parser.add_argument(
        "--heal",
        action="store_true",
        help="compare healing in place with today's restart from memory (same kill)",
    )
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="build the model on the CPU with a random init on every attempt (not on meta)",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kill_at = rng.randint(args.memory_every + 1, args.every - 1)
    kill_rank = rng.randrange(4)
    work = tempfile.mkdtemp(prefix="nbtools-bench-recovery-")
    shm = tempfile.mkdtemp(prefix="nbtools-bench-recovery-", dir="/dev/shm")
    os.environ["NBTOOLS_SNAPSHOT_DIR"] = shm
    result: dict = {
        "ranks": 4,
        "every": args.every,
        "memory_every": args.memory_every,
        "kill_at": kill_at,
        "kill_rank": kill_rank,
        "random_init": args.random_init,
        "volume": "local directory" if args.local else f"capped S3 at {args.mbps:g} MB/s",
    }
    try:
        with _null() if args.local else s3_server(args.mbps) as endpoint:
            if endpoint:
                os.environ.update(s3_env(endpoint))
                import s3fs

                fs = s3fs.S3FileSystem()
                fs.mkdir(BUCKET)
            launches = [("volume", None, False), ("memory", args.memory_every, False)]
            if args.heal:
                launches = [("memory", args.memory_every, False), ("heal", args.memory_every, True)]
            for name, memory_every, heal in launches:
                root = os.path.join(work, name) if args.local else f"s3://{BUCKET}/{name}"
                cfg = {
                    "root": root,
                    "work": work,
                    "tests": os.path.join(_HERE, "..", "tests", "checkpoint"),
                    "endpoint": endpoint,
                    "state_mb": args.state_mb,
                    "every": args.every,
                    "memory_every": memory_every,
                    "kill_at": kill_at,
                    "kill_rank": kill_rank,
                    "random_init": args.random_init,
                    "first": os.path.join(work, f"{name}-first.json"),
                    "killed": os.path.join(work, f"{name}-killed.json"),
                    "name": name,
                    "heal": heal,
                }
                result[name] = _launch(cfg)
            if not args.heal:
                result["paired"] = _paired(
                    {
                        "work": work,
                        "state_mb": args.state_mb,
                        "memory_every": args.memory_every,
                        "cycles": args.rate_cycles,
                    }
                )
            if endpoint:
                s3fs.S3FileSystem.close_session(fs.loop, fs.s3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.heal:
        mem, heal = result["memory"], result["heal"]
        result["state_mb_per_rank"] = mem.pop("state_mb_per_rank")
        heal.pop("state_mb_per_rank")
        result["heal_x"] = round(heal["kill_to_next_step_s"] / mem["kill_to_next_step_s"], 3)
        result["steps_trained_again"] = heal["steps_trained_again"]
        result["survivors_kept_pids"] = heal["survivors_kept_pids"]
        print(json.dumps(result))
        return
    mem, vol = result["memory"], result["volume"]
    result["state_mb_per_rank"] = mem.pop("state_mb_per_rank")
    vol.pop("state_mb_per_rank")
    result["kill_to_next_step_x"] = round(
        mem["kill_to_next_step_s"] / vol["kill_to_next_step_s"], 3
    )
    result["steps_per_s_x"] = result["paired"]["x"]
    print(json.dumps(result))


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
