"""Launch latency on a 3-node local Ray cluster, 4 CPU ranks: nbtools against Ray Train.

Both run the same function (one all_reduce, return) on 4 gloo ranks:
``@distributed(processes=4, cluster="ray")`` first and warm calls, and Ray
Train's ``TorchTrainer.fit()``, each starting its actors fresh. nbtools'
start-up is split into placement + actor start, process group and function.
Prints one JSON line. Run: ``python benchmarks/launch_ray.py`` (needs ``ray[train]``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported

import ray
from ray.cluster_utils import Cluster

WORLD = 4
WARM_CALLS = 3


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _nbtools_call() -> tuple[float, dict[str, float]]:
    from nbtools.launch import _payload, _runner
    from nbtools.launch._ray import RayBackend

    backend = RayBackend()
    start = time.perf_counter()
    # What DistributedFunction.distributed does, keeping the backend to read its timings.
    backend.check(WORLD, False)
    plan = _runner.Plan(WORLD, False, 0, "none")
    results = _runner.run(_payload.pack(_all_reduce, (), {}), plan, backend=backend)
    elapsed = time.perf_counter() - start
    assert len(results) == WORLD
    return elapsed, dict(backend.timings)


def _ray_train_fit(storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        lambda: _all_reduce(),
        scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
        run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit()
    return time.perf_counter() - start


def main() -> None:
    scratch = tempfile.mkdtemp(prefix="nbtools-bench-ray-")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        first, first_split = _nbtools_call()
        warm = [_nbtools_call() for _ in range(WARM_CALLS)]
        fits = [_ray_train_fit(scratch) for _ in range(2)]
        warm_s = statistics.median(t for t, _ in warm)
        split = warm[len(warm) // 2][1]
        baseline = statistics.median(fits)
        print(
            json.dumps(
                {
                    "benchmark": "launch_ray",
                    "nodes": 3,
                    "world_size": WORLD,
                    "nbtools_first_call_s": round(first, 3),
                    "nbtools_warm_call_s": round(warm_s, 3),
                    "nbtools_first_split_s": {k: round(v, 3) for k, v in first_split.items()},
                    "nbtools_warm_split_s": {k: round(v, 3) for k, v in split.items()},
                    "ray_train_fit_s": round(baseline, 3),
                    "ray_train_fit_runs_s": [round(f, 3) for f in fits],
                    "first_call_ratio": round(first / baseline, 3),
                    "warm_call_ratio": round(warm_s / baseline, 3),
                    "goal_first_call_ratio": 0.5,
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
