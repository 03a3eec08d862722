"""Launch latency on 2 CPU ranks: nbtools first and warm calls against spawn and accelerate.

Each launcher runs the same work: initialise the group, one all_reduce, return.
The first call starts its ranks fresh while the forkserver imports its preloads in
the background; the warm calls come once it is ready (``forkserver_ready_after_s``,
from the decoration) and fork their ranks from it.
Then large results: each of the 2 ranks returns a 200 MB tensor, against a
forkserver ``multiprocessing.Pool`` returning the same (median of paired tries),
once from ``@distributed`` and once from ``RankPool.run``; and a small result
(a dict of two numbers) from ``RankPool.run`` against the same Pool.
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
SMALL_CALLS = 30


def _result_tensor(rank: int) -> torch.Tensor:
    return torch.full((RESULT_FLOATS,), float(rank))


def _small_result(rank: int) -> dict:
    return {"rank": rank, "loss": 0.25}


def _rank_tensor() -> torch.Tensor:
    return _result_tensor(dist.get_rank())


def _rank_small() -> dict:
    return _small_result(dist.get_rank())


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


def _time_pool_results() -> tuple[float, float, float, float]:
    """``RankPool.run`` against a forkserver Pool: 200 MB per rank, then a small result.

    Returns the medians: pool large, Pool large, pool small, Pool small (seconds).
    """
    import multiprocessing

    from nbtools.launch import RankPool

    ctx = multiprocessing.get_context("forkserver")
    ours, theirs, ours_small, theirs_small = [], [], [], []
    with RankPool(processes=WORLD, output="none") as ranks, ctx.Pool(WORLD) as pool:
        ranks.run(_rank_tensor)  # warm
        pool.map(_result_tensor, range(WORLD))
        for _ in range(RESULT_TRIES):
            start = time.perf_counter()
            values = ranks.run(_rank_tensor)
            ours.append(time.perf_counter() - start)
            assert float(values[1][0]) == 1.0
            del values
            start = time.perf_counter()
            values = pool.map(_result_tensor, range(WORLD))
            theirs.append(time.perf_counter() - start)
            del values
        for _ in range(SMALL_CALLS):
            start = time.perf_counter()
            assert ranks.run(_rank_small)[1] == {"rank": 1, "loss": 0.25}
            ours_small.append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.map(_small_result, range(WORLD))
            theirs_small.append(time.perf_counter() - start)
    return tuple(statistics.median(s) for s in (ours, theirs, ours_small, theirs_small))  # type: ignore[return-value]


def _forkserver_ready(start: float, timeout: float = 120.0) -> float | None:
    """Seconds from ``start`` until the forkserver has imported every preload (None: not
    within ``timeout``)."""
    from nbtools.launch._local import _forkserver

    deadline = time.perf_counter() + timeout
    while not _forkserver.ready():
        if time.perf_counter() > deadline:
            return None
        time.sleep(0.05)
    return time.perf_counter() - start


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
    # Calls made while the forkserver still imports its preloads start their ranks fresh
    # (spawn); a warm call is one that forks them from it: wait until it is ready.
    ready_after = _forkserver_ready(start)
    warm = []
    for _ in range(WARM_CALLS):
        start = time.perf_counter()
        reduce_once.distributed()
        warm.append(time.perf_counter() - start)
    warm_s = statistics.median(warm)
    result_s, pool_s = _time_large_results(distributed)
    ranks_s, ranks_pool_s, small_s, small_pool_s = _time_pool_results()
    spawn_s = _time_spawn()
    accelerate_s = _time_accelerate()
    figures = {
        "benchmark": "launch",
        "ranks": WORLD,
        "nbtools_first_s": round(first, 4),
        "forkserver_ready_after_s": None if ready_after is None else round(ready_after, 3),
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
        "rankpool_large_result_s": round(ranks_s, 4),
        "mp_forkserver_pool_large_result_same_pass_s": round(ranks_pool_s, 4),
        "rankpool_large_result_over_pool": round(ranks_s / ranks_pool_s, 3),
        "rankpool_small_result_ms": round(small_s * 1000, 3),
        "mp_forkserver_pool_small_result_ms": round(small_pool_s * 1000, 3),
        "rankpool_small_result_over_pool": round(small_s / small_pool_s, 3),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
