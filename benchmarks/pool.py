"""Warm call latency of persistent ranks on 2 CPU ranks, against fresh ranks and ipyparallel.

Every variant runs the same work: one ``all_reduce`` of a one-element tensor.

- ``warm_distributed_ms``: ``@distributed(processes=2)``, warm (fresh ranks per call);
- ``warm_pool_ms``: ``RankPool(processes=2).run(fn)``;
- ``warm_cell_ms``: a ``%%distributed`` cell through IPython's ``InteractiveShell``;
- ``ipyparallel_ms``: ``view.apply_sync(fn)`` on 2 ipyparallel engines whose torch
  process group was formed once beforehand (the baseline notebook users know).

- ``push_1gib_s``: ``pool.push(x=<1 GiB tensor>)`` to 2 ranks, against
  ``file_roundtrip_1gib_s``, a ``torch.save`` + ``torch.load`` of the same tensor
  through a local file, measured in the same run (goal: push <= 1.5x the round trip);
  ``pull_2x512mib_s`` pulls a 512 MiB tensor from each rank;
  ``push_socket_1gib_s`` is the same push to ranks that cannot open the kernel's
  memory files (hardened ``/proc``, forced with ``NBTOOLS_POOL_SHARED_MEMORY=0``):
  the buffers stream through each rank's socket.

With CUDA, ``gpu`` adds the first call, the warm call without a pool and the warm
pool call on one GPU. Prints one JSON line. Run: ``python benchmarks/pool.py``
(the ipyparallel baseline needs ``pip install ipyparallel``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

WORLD = 2
WARM_DISTRIBUTED = 7
WARM_POOL = 50


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda" if torch.cuda.is_initialized() else "cpu")
    dist.all_reduce(t)
    return t.item()


def _median_ms(call, times: int) -> float:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1000, 3)


def _distributed_ms(**ranks) -> tuple[float, float]:
    from nbtools.launch import distributed

    fn = distributed(output="none", **ranks)(_all_reduce)
    start = time.perf_counter()
    fn.distributed()
    first = (time.perf_counter() - start) * 1000
    return round(first, 1), _median_ms(fn.distributed, WARM_DISTRIBUTED)


def _pool_ms(**ranks) -> float:
    from nbtools.launch import RankPool

    with RankPool(output="none", **ranks) as pool:
        pool.run(_all_reduce)
        return _median_ms(lambda: pool.run(_all_reduce), WARM_POOL)


def _push_by_socket_s(x) -> float:
    from nbtools.launch import RankPool

    os.environ["NBTOOLS_POOL_SHARED_MEMORY"] = "0"
    try:
        with RankPool(processes=WORLD, output="none") as pool:
            pool.execute("import torch")
            start = time.perf_counter()
            pool.push(x=x)
            seconds = time.perf_counter() - start
            assert pool.execute("float(x.sum())") == [float(x.numel())] * WORLD
    finally:
        del os.environ["NBTOOLS_POOL_SHARED_MEMORY"]
    return seconds


def _push_vs_file() -> dict:
    import torch

    from nbtools.launch import RankPool

    x = torch.ones(1024**3 // 4)  # 1 GiB
    by_socket = _push_by_socket_s(x)
    with RankPool(processes=WORLD, output="none") as pool:
        pool.execute("import torch")
        start = time.perf_counter()
        pool.push(x=x)
        push = time.perf_counter() - start
        sums = pool.execute("float(x.sum())")
        assert sums == [float(x.numel())] * WORLD, sums
        pool.execute("del x\nhalf = torch.ones(512 * 1024**2 // 4)")
        start = time.perf_counter()
        halves = pool.pull("half")
        pull = time.perf_counter() - start
        del halves
        pool.execute("del half")
    scratch = tempfile.mkdtemp(prefix="nbtools-bench-file-")
    try:
        path = os.path.join(scratch, "x.pt")
        start = time.perf_counter()
        torch.save(x, path)
        back = torch.load(path)
        roundtrip = time.perf_counter() - start
        assert back.numel() == x.numel()
        del back
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "push_1gib_s": round(push, 3),
        "file_roundtrip_1gib_s": round(roundtrip, 3),
        "push_vs_file": round(push / roundtrip, 3),
        "pull_2x512mib_s": round(pull, 3),
        "push_socket_1gib_s": round(by_socket, 3),
    }


def _cell_ms() -> float:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "nbtools")
    cell = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_line_magic("distributed", f"start --processes {WORLD} --output none")
        try:
            shell.run_cell_magic(
                "distributed", "", "import torch\nimport torch.distributed as dist"
            )
            shell.run_cell_magic("distributed", "", cell)
            return _median_ms(lambda: shell.run_cell_magic("distributed", "", cell), WARM_POOL)
        finally:
            shell.run_line_magic("distributed", "stop")


def _ipp_group(store: str, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _ipp_ms() -> tuple[float | None, str | None]:
    try:
        import ipyparallel as ipp
    except ImportError:
        return None, None
    scratch = tempfile.mkdtemp(prefix="nbtools-bench-ipp-")
    cluster = ipp.Cluster(
        n=WORLD,
        controller_ip="127.0.0.1",
        profile_dir=scratch,
        log_level=40,
        engine_args=["--log-level=40"],
        controller_args=["--log-level=40"],
    )
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(WORLD, timeout=120)
        view = client[:]
        view.use_cloudpickle()
        store = os.path.join(scratch, "store")
        joins = [client[e].apply_async(_ipp_group, store, r) for r, e in enumerate(client.ids)]
        for join in joins:  # the engines form their torch group once, together
            join.get(timeout=120)
        view.apply_sync(_all_reduce)
        ms = _median_ms(lambda: view.apply_sync(_all_reduce), WARM_POOL)
        client.close()
        return ms, ipp.__version__
    finally:
        cluster.stop_cluster_sync()
        shutil.rmtree(scratch, ignore_errors=True)


def _gpu() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # as in a notebook that already used the GPU
    first, warm = _distributed_ms(gpus=1)
    pool = _pool_ms(gpus=1)
    return {
        "first_call_ms": first,
        "warm_distributed_ms": warm,
        "warm_pool_ms": pool,
        "pool_vs_distributed": round(pool / warm, 4),
        "device": torch.cuda.get_device_name(0),
    }


def main() -> None:
    _, warm = _distributed_ms(processes=WORLD)
    pool = _pool_ms(processes=WORLD)
    cell = _cell_ms()
    ipp, ipp_version = _ipp_ms()
    transfer = _push_vs_file()
    result = {
        "benchmark": "pool",
        "ranks": WORLD,
        "warm_distributed_ms": warm,
        "warm_pool_ms": pool,
        "warm_cell_ms": cell,
        "ipyparallel_ms": ipp,
        "ipyparallel_version": ipp_version,
        "pool_vs_distributed": round(pool / warm, 4),
        "pool_vs_ipyparallel": round(pool / ipp, 4) if ipp else None,
        **transfer,
        "goals_met": {
            "push_le_1.5x_file_roundtrip": transfer["push_vs_file"] <= 1.5,
            "pool_le_5ms": pool <= 5.0,
            "pool_le_0.1x_distributed": pool <= 0.1 * warm,
            "pool_le_1x_ipyparallel": None if ipp is None else pool <= ipp,
        },
        "gpu": _gpu(),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
