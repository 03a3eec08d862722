"""Launch latency on 2 CPU ranks: nbtools first and warm calls against spawn and accelerate.

Each launcher runs the same work: initialise the group, one all_reduce, return.
Then large results: each of the 2 ranks returns a 200 MB tensor, against a
forkserver ``multiprocessing.Pool`` returning the same (median of paired tries).
Prints one JSON line. Run: ``python benchmarks/launch.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
WARM_CALLS = 7
RESULT_FLOATS = 50_000_000  # 200 MB of float32 per rank
RESULT_TRIES = 3


def _result_tensor(rank: int) -> torch.Tensor:
    return torch.full((RESULT_FLOATS,), float(rank))


def _all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawned(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    _all_reduce()
    dist.destroy_process_group()


def _accelerated() -> None:
    dist.init_process_group("gloo")  # accelerate sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
    _all_reduce()
    dist.destroy_process_group()


def _time_spawn() -> float:
    scratch = tempfile.mkdtemp(prefix="nbtools-bench-")
    try:
        start = time.perf_counter()
        mp.spawn(_spawned, args=(os.path.join(scratch, "store"),), nprocs=WORLD)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _time_accelerate() -> float | None:
    try:
        from accelerate import notebook_launcher
    except ImportError:
        return None
    # It leaves a torchelastic_* log directory behind: keep that in a scratch directory.
    scratch = tempfile.mkdtemp(prefix="nbtools-bench-")
    saved, tempfile.tempdir = tempfile.tempdir, scratch
    try:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # it announces itself; keep one JSON line
            notebook_launcher(_accelerated, num_processes=WORLD, use_port=str(_free_port()))
        return time.perf_counter() - start
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(scratch, ignore_errors=True)


def _time_large_results(distributed) -> tuple[float, float]:
    """Median seconds for 2 ranks to return 200 MB each: nbtools, then a forkserver Pool."""
    import multiprocessing

    @distributed(processes=WORLD, output="none")
    def large() -> torch.Tensor:
        return _result_tensor(dist.get_rank())

    large.distributed()  # warm
    ctx = multiprocessing.get_context("forkserver")
    ours, theirs = [], []
    with ctx.Pool(WORLD) as pool:
        pool.map(_result_tensor, range(WORLD))  # warm
        for _ in range(RESULT_TRIES):
            start = time.perf_counter()
            values = large.distributed()
            ours.append(time.perf_counter() - start)
            assert float(values[1][0]) == 1.0
            start = time.perf_counter()
            values = pool.map(_result_tensor, range(WORLD))
            theirs.append(time.perf_counter() - start)
            del values
    return statistics.median(ours), statistics.median(theirs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    from nbtools import distributed

    start = time.perf_counter()  # from the decoration: it starts the forkserver

    @distributed(processes=WORLD, output="none")
    def reduce_once() -> float:
        return _all_reduce()

    assert reduce_once.distributed() == [float(WORLD)] * WORLD
    first = time.perf_counter() - start
    warm = []
    for _ in range(WARM_CALLS):
        start = time.perf_counter()
        reduce_once.distributed()
        warm.append(time.perf_counter() - start)
    warm_s = statistics.median(warm)
    result_s, pool_s = _time_large_results(distributed)
    spawn_s = _time_spawn()
    accelerate_s = _time_accelerate()
    figures = {
        "benchmark": "launch",
        "ranks": WORLD,
        "nbtools_first_s": round(first, 4),
        "nbtools_warm_median_s": round(warm_s, 4),
        "nbtools_warm_all_s": [round(w, 4) for w in warm],
        "mp_spawn_s": round(spawn_s, 4),
        "accelerate_notebook_launcher_s": None if accelerate_s is None else round(accelerate_s, 4),
        "first_over_spawn": round(first / spawn_s, 3),
        "warm_over_spawn": round(warm_s / spawn_s, 3),
        "warm_over_accelerate": None if accelerate_s is None else round(warm_s / accelerate_s, 3),
        "result_mb_per_rank": RESULT_FLOATS * 4 // 10**6,
        "nbtools_large_result_s": round(result_s, 4),
        "mp_forkserver_pool_large_result_s": round(pool_s, 4),
        "large_result_over_pool": round(result_s / pool_s, 3),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
