"""Hangs and stragglers: how fast they are named, what reporting costs, false flags.

Prints one JSON line. Run: ``python benchmarks/stragglers.py``
(``NBTOOLS_BENCH_HEALTHY_S`` sets the healthy run's length; 180 s by default;
``python benchmarks/stragglers.py phases`` runs only the long phases below).

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

Long phases that are not hangs, and hangs before the first step, on two ranks
with default settings (hang warnings counted, goal 0, and the one-line notices
of a rank busy outside collectives). A first launch warms the launcher up (its
forkserver's preloads), as a notebook's later calls find it, so that the first
case times its phase and not the launcher's cold start:

- Save: both ranks save a 64 MB model with ``CheckpointManager`` (``async_save=False``)
  to a slow directory: an fsspec filesystem whose uploads go at 256 KB/s for 90 s
  from a rank's first (64 KB writes, each after a 0.25 s wait, as to a remote mount;
  the FUSE passthrough of ``benchmarks/_slowfs.py`` is read-only). The rank that
  holds the 64 MB weight (DCP writes a replicated tensor once) waits on the
  manager's upload threads while the other waits for it in the manager's collectives
  (``save_blocked_s``: how long the save held that rank).
- Compile: rank 0's first step takes 70 s, its main thread waiting for two
  worker processes that compute, while rank 1 waits in DDP's all-reduce.
- Evaluate: rank 0 alone computes for 100 s (``if rank == 0: evaluate()``)
  while rank 1 waits in a barrier.
- Deadlock before the first step: rank 1 blocks on a lock it holds before its
  first step; seconds from the call, and from the launch on the kernel's clock
  (which the bound counts from), until its ``hang`` event (goal: at the start-up
  bound, within a watchdog tick: the watchdog's two looks at the collectives come
  before it), and which ranks it named (goal: rank 1 only).
- Clock skew: rank 1's clock reads 60 s behind the kernel's for a 60 s run:
  flags raised (goal: 0).
- Busy or stuck: the kernel's CPU time for one look at a rank (its process
  tree's CPU time and bytes read and written, and its training thread's
  state), on a process with torch loaded and one child; the watchdog looks
  once a second per rank for the tree and ten times for the thread. A rank's
  probe of itself (``events._probe``) does as much each second: its share of
  one core (``rank_probe_cpu_share``).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nbtools import distributed, events

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


_KEPT = ("hang", "straggler", "long_phase", "bench_stop", "bench_slow", "checkpoint_saved")


def _run(mode: str, seconds: float, until=None, train=_train, *more):
    seen: list[events.Event] = []
    t0 = time.time()

    def keep(batch):
        for event in batch:
            if event.kind in _KEPT:
                seen.append(event)
                if until is not None:
                    until(event)

    events.subscribe(keep)
    try:
        results = train.distributed(mode, seconds, *more)
    except Exception as exc:  # noqa: BLE001 - a phase that ends in a failure still counts
        results = [repr(exc)[:200]]
    finally:
        events.unsubscribe(keep)
    return results, seen, time.time() - t0


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))


@distributed(processes=2, output="none", on_hang="restart", max_restarts=0)
def _phases(mode: str, seconds: float, root: str = ""):
    import multiprocessing
    import threading

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if mode == "skew" and rank == 1:  # this rank's clock reads a minute behind
        from nbtools.events import _emit, _progress

        _emit._time = _progress._time = lambda: time.time() - 60
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    ckpt = _slow_manager(root, seconds) if mode == "save" else None
    big = torch.nn.Linear(4096, 4096) if mode == "save" else None  # 64 MB to save
    if mode == "deadlock" and rank == 1:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # before the first step: rank 0 waits in DDP's all-reduce
    began = time.monotonic()
    for step in range(10_000):
        if mode == "compile" and step == 0 and rank == 0:
            workers = [multiprocessing.Process(target=_burn, args=(seconds,)) for _ in range(2)]
            for worker in workers:
                worker.start()
            for worker in workers:  # the main thread waits for its compile workers
                worker.join()
        time.sleep(0.05)
        model(torch.randn(8, 16)).sum().backward()
        events.step(step)
        if step == 20 and mode in ("save", "evaluate"):
            if ckpt is not None:  # the rank with the weight uploads for `seconds`
                ckpt.save(step, model=big)
            if rank == 0 and mode == "evaluate":
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    torch.randn(128, 128) @ torch.randn(128, 128)
            dist.barrier()
        late = mode in ("save", "evaluate") or time.monotonic() - began > seconds
        done = torch.tensor([float(step > 30 and late)])
        dist.all_reduce(done)  # every rank stops at the same step
        if done.item() > 0:
            break
    if ckpt is not None:
        ckpt.close(final_save=False)
    return step


def _slow_manager(root: str, seconds: float):
    """A ``CheckpointManager`` saving to ``root`` through a slow fsspec filesystem: a rank's
    uploads go 64 KB at a time, each after a 0.25 s wait, for ``seconds`` from its first."""
    import threading

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from nbtools.checkpoint import CheckpointManager

    gate = threading.Lock()  # one write at a time: 256 KB/s whatever the upload threads
    began: list[float] = []

    class SlowMount(LocalFileSystem):
        """A remote volume that each rank reaches at 256 KB/s."""

        protocol = "nbtslowbench"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("nbtslowbench://"))

        def put_file(self, lpath, rpath, **kwargs):
            if not began:
                began.append(time.monotonic())
            rpath = self._strip_protocol(rpath)
            self.makedirs(self._parent(rpath), exist_ok=True)
            with open(lpath, "rb") as src, open(rpath, "wb") as dst:
                while chunk := src.read(64 << 10):
                    if time.monotonic() - began[0] < seconds:
                        with gate:
                            time.sleep(0.25)  # waiting on the remote end, using no CPU
                    dst.write(chunk)
            return None

    fsspec.register_implementation("nbtslowbench", SlowMount, clobber=True)
    return CheckpointManager(f"nbtslowbench://{root}", every=None, async_save=False)


def _warm() -> None:
    """Nothing: a first launch, so that the forkserver is up."""


def _warm_up() -> None:
    """Launch once and wait for the forkserver's preloads, as a notebook's later calls find it:
    the first case would otherwise also time the launcher's own cold start (half a minute
    and more on a loaded machine)."""
    from nbtools.launch._local import _forkserver

    distributed(processes=2, output="none")(_warm).distributed()
    deadline = time.monotonic() + 120
    while not _forkserver.ready() and time.monotonic() < deadline:
        time.sleep(0.1)


def _long_phases(out: dict) -> None:
    import tempfile

    from nbtools.events import _probe

    _warm_up()
    for mode, seconds in (("save", 90.0), ("compile", 70.0), ("evaluate", 100.0)):
        with tempfile.TemporaryDirectory(prefix="nbtools-bench-") as root:
            results, seen, took = _run(mode, seconds, None, _phases, root)
        if mode == "save":
            out["save_steps"] = results  # the step each rank ended at, or the failure
            # How long the save held the rank that uploads the weight.
            saves = [e.fields.get("blocked_s", 0.0) for e in seen if e.kind == "checkpoint_saved"]
            out["save_blocked_s"] = round(max(saves), 1) if saves else None
        opened = [e for e in seen if not e.fields.get("ended")]
        out[f"{mode}_s"] = round(took, 1)
        out[f"{mode}_hang_warnings"] = len([e for e in opened if e.kind == "hang"])
        out[f"{mode}_busy_lines"] = len([e for e in opened if e.kind == "long_phase"])
    began = time.time()
    _, seen, took = _run("deadlock", 0.0, train=_phases)
    hangs = [e for e in seen if e.kind == "hang" and not e.fields.get("ended")]
    out["deadlock_first_step_detect_s"] = round(hangs[0].time - began, 1) if hangs else None
    out["deadlock_first_step_bound_s"] = hangs[0].fields.get("bound_s") if hangs else None
    # From the launch, on the kernel's clock, as the bound counts.
    out["deadlock_first_step_from_launch_s"] = hangs[0].fields.get("stalled_s") if hangs else None
    out["deadlock_first_step_ranks_named"] = sorted({e.rank for e in hangs})
    _, seen, took = _run("skew", 60.0, train=_phases)
    out["clock_skew_60s_false_flags"] = len(
        [e for e in seen if e.kind in ("hang", "straggler") and not e.fields.get("ended")]
    )
    import subprocess

    # A rank-like process: torch loaded, its threads started, one child (a loader worker).
    code = (
        "import multiprocessing, time, torch; torch.ones(1).sum(); "
        "multiprocessing.Process(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    )
    rank = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(8)
        looks = 1000
        t0 = time.process_time()
        for _ in range(looks):
            _probe.usage(rank.pid)
            _probe.sample(rank.pid)
        out["busy_probe_cpu_us_per_rank_look"] = round((time.process_time() - t0) / looks * 1e6, 1)
        # A rank's probe of itself: ten thread samples and one tree read a second.
        t0 = time.process_time()
        for _ in range(looks):
            _probe.sample(rank.pid)
        sample_s = (time.process_time() - t0) / looks
        t0 = time.process_time()
        for _ in range(looks):
            _probe.usage(rank.pid)
        usage_s = (time.process_time() - t0) / looks
        out["rank_probe_cpu_share"] = round(10 * sample_s + usage_s, 6)
    finally:
        rank.kill()
        rank.wait()


def main() -> None:
    out: dict = {"ranks": WORLD, "step_s": STEP_S, "jitter": JITTER}
    if sys.argv[1:] == ["phases"]:
        out = {"phase_ranks": 2}
        _long_phases(out)
        print(json.dumps(out))
        return

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
    _long_phases(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
