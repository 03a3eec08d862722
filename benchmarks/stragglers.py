"""Hangs and stragglers: how fast they are named, what reporting costs, false flags.

Prints one JSON line. Run: ``python benchmarks/stragglers.py``
(``NBTOOLS_BENCH_HEALTHY_S`` sets the healthy run's length; 180 s by default).

Four CPU ranks (gloo) train a small DDP model; each step "computes" for
0.2 s +-30 % (a sleep, as a GPU kernel would leave the CPU free) and reports
it with ``events.step``. Default settings throughout (adaptive hang bound,
threshold 0.75, 30 s window).

- SIGSTOP: rank 2 stops itself mid-step; seconds from the stop until the
  kernel's ``hang`` event (goal: <= 60 s and <= 2x the adaptive bound), and
  which ranks it named (goal: rank 2 only). The kernel then sends SIGCONT.
- Half speed: from step 40 rank 3 computes twice as long; seconds from the
  slowdown until its ``straggler`` event (goal: <= 120 s), and which ranks.
- Overhead: in every rank, 200,000 calls of ``events.step`` against the same
  loop calling an empty function, per call, in the same process (goal: <= 5 us).
- False flags: a healthy run with jitter, an evaluation every 200 steps (each
  rank pausing a different time, then a barrier) and a checkpoint save every
  100 steps (``checkpoint_saved``, rank 0 blocked longer): flags raised (goal: 0).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nbtools import distributed, events  # noqa: E402

WORLD, STEP_S, JITTER = 4, 0.2, 0.3
HEALTHY_S = float(os.environ.get("NBTOOLS_BENCH_HEALTHY_S", "180"))


@distributed(processes=WORLD, output="none")
def _train(mode: str, seconds: float):
    import random
    import timeit

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    rng = random.Random(rank)
    calls = 200_000
    noop = lambda step: None  # noqa: E731
    base = min(timeit.repeat("f(1)", globals={"f": noop}, number=calls, repeat=3)) / calls
    cost = min(timeit.repeat("f(1)", globals={"f": events.step}, number=calls, repeat=3)) / calls
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    began = time.time()
    step = 0
    while True:
        if mode == "stop" and rank == 2 and step == 40:
            events.emit("bench_stop")
            events.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "slow" and rank == 3 and step == 40:
            events.emit("bench_slow")
        pause = STEP_S * rng.uniform(1 - JITTER, 1 + JITTER)
        if mode == "slow" and rank == 3 and step >= 40:
            pause *= 2
        time.sleep(pause)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        events.step(step)
        step += 1
        if mode == "healthy":
            if step % 200 == 0:  # evaluation: each rank its own length, then together again
                time.sleep(rng.uniform(2.0, 6.0))
                dist.barrier()
            if step % 100 == 0:
                time.sleep(1.0 if rank == 0 else 0.3)
                events.emit("checkpoint_saved", step=step, blocked_s=0.3)
        done = torch.tensor([float(time.time() - began > seconds)])
        dist.all_reduce(done)  # every rank stops at the same step
        if done.item() > 0:
            return {"base_s": base, "step_s": cost, "steps": step}


def _run(mode: str, seconds: float, until=None):
    seen: list[events.Event] = []
    t0 = time.time()

    def keep(batch):
        for event in batch:
            if event.kind in ("hang", "straggler", "bench_stop", "bench_slow"):
                seen.append(event)
                if until is not None:
                    until(event)

    events.subscribe(keep)
    try:
        results = _train.distributed(mode, seconds)
    finally:
        events.unsubscribe(keep)
    return results, seen, time.time() - t0


def main() -> None:
    out: dict = {"ranks": WORLD, "step_s": STEP_S, "jitter": JITTER}

    def resume(event):
        if event.kind == "hang" and not event.fields.get("ended") and event.fields.get("rank_pid"):
            os.kill(event.fields["rank_pid"], signal.SIGCONT)

    results, seen, _ = _run("stop", 100.0, until=resume)
    stop = next(e.time for e in seen if e.kind == "bench_stop")
    hangs = [e for e in seen if e.kind == "hang" and not e.fields.get("ended")]
    out["sigstop_detect_s"] = round(hangs[0].time - stop, 1) if hangs else None
    out["sigstop_bound_s"] = hangs[0].fields.get("bound_s") if hangs else None
    out["sigstop_ranks_named"] = sorted({e.rank for e in hangs})
    out["sigstop_cleared"] = any(e.kind == "hang" and e.fields.get("ended") for e in seen)

    results, seen, _ = _run("slow", 110.0)
    slow = next(e.time for e in seen if e.kind == "bench_slow")
    flagged = [e for e in seen if e.kind == "straggler" and not e.fields.get("ended")]
    out["half_speed_detect_s"] = round(flagged[0].time - slow, 1) if flagged else None
    out["half_speed_ranks_named"] = sorted({e.rank for e in flagged})
    out["half_speed_score"] = flagged[0].fields.get("score") if flagged else None

    results, seen, took = _run("healthy", HEALTHY_S)
    out["healthy_run_s"] = round(took, 1)
    out["healthy_steps"] = results[0]["steps"]
    out["false_flags"] = len(
        [e for e in seen if e.kind in ("hang", "straggler") and not e.fields.get("ended")]
    )
    per_call = [r["step_s"] for r in results]
    empty = [r["base_s"] for r in results]
    out["events_step_us"] = round(statistics.median(per_call) * 1e6, 3)
    out["empty_call_us"] = round(statistics.median(empty) * 1e6, 3)
    out["overhead_us"] = round((statistics.median(per_call) - statistics.median(empty)) * 1e6, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
