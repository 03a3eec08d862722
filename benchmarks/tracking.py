"""Caller-side cost of logging one metric: nbtools' MlflowLogger against MLflow's own calls.

Prints one JSON line. All three log into MLflow's default kind of local store (a
sqlite database, here in a temporary directory that is removed afterwards):

- ``mlflow_sync``: ``mlflow.log_metric(key, value, step)``, the baseline;
- ``mlflow_async``: ``mlflow.log_metric(..., synchronous=False)``;
- ``nbtools``: ``MlflowLogger.log_metric(key, value, step)`` (batched in a thread).

Figures are microseconds per call on the calling (training) thread, mean and
99th percentile; the time to drain what was queued is reported separately, and
every value is checked to have reached the store, and ``stored_per_s`` is how many
values per second reach the store (queueing and draining together).

``start`` is what starting a run on a new sqlite store costs the calling thread,
each try in a fresh process with mlflow and nbtools already imported: the
baseline ``mlflow.start_run()`` against ``MlflowLogger()``, which opens the store
in the background (``nbtools_run_open_s``: until its run id is known).

Usage: ``python benchmarks/tracking.py [--sync-calls N] [--calls N]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _per_call(fn, n: int) -> dict[str, float]:
    """Call ``fn(i)`` n times; microseconds per call (mean over the loop, p99 of single calls)."""
    clock = time.perf_counter_ns
    singles = []
    start = clock()
    for i in range(n):
        t0 = clock()
        fn(i)
        singles.append(clock() - t0)
    total = clock() - start
    singles.sort()
    return {
        "mean_us": round(total / n / 1e3, 3),
        "p50_us": round(statistics.median(singles) / 1e3, 3),
        "p99_us": round(singles[int(0.99 * (n - 1))] / 1e3, 3),
        "calls": n,
    }


_START = r"""
import json, os, sys, tempfile, time
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
import mlflow
import mlflow.store.tracking.sqlalchemy_store  # imported by both before the clock starts
from nbtools.tracking import MlflowLogger
with tempfile.TemporaryDirectory(prefix="nbtools-bench-start-") as tmp:
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
    t0 = time.perf_counter()
    if sys.argv[1] == "mlflow":
        run = mlflow.start_run(experiment_id=mlflow.create_experiment("start"))
        blocked = opened = time.perf_counter() - t0
        mlflow.end_run()
    else:
        logger = MlflowLogger("start")
        blocked = time.perf_counter() - t0
        logger.run_id
        opened = time.perf_counter() - t0
        logger.close()
print(json.dumps([blocked, opened]))
"""


def _start_costs(tries: int) -> dict[str, float]:
    """Seconds the caller waits to start a run on a new store, medians over fresh processes."""
    import subprocess

    seen: dict[str, list[list[float]]] = {"mlflow": [], "nbtools": []}
    for _ in range(tries):
        for who in seen:  # alternated, so both see the same machine
            out = subprocess.run(
                [sys.executable, "-c", _START, who], capture_output=True, text=True, check=True
            ).stdout
            seen[who].append(json.loads(out.strip().splitlines()[-1]))
    median = {
        who: [statistics.median(t[i] for t in runs) for i in (0, 1)] for who, runs in seen.items()
    }
    return {
        "tries": tries,
        "mlflow_start_run_s": round(median["mlflow"][0], 3),
        "nbtools_blocked_s": round(median["nbtools"][0], 4),
        "nbtools_run_open_s": round(median["nbtools"][1], 3),
        "blocked_over_mlflow": round(median["nbtools"][0] / median["mlflow"][0], 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sync-calls", type=int, default=300, help="calls of the synchronous baseline"
    )
    parser.add_argument(
        "--async-calls", type=int, default=2000, help="calls of MLflow's async mode"
    )
    parser.add_argument("--calls", type=int, default=30_000, help="calls of nbtools' logger")
    parser.add_argument(
        "--start-tries", type=int, default=3, help="fresh processes per run start measured"
    )
    args = parser.parse_args(argv)
    start = _start_costs(args.start_tries)

    with tempfile.TemporaryDirectory(prefix="nbtools-bench-tracking-") as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        import mlflow

        from nbtools.tracking import MlflowLogger

        experiment = mlflow.MlflowClient().create_experiment("nbtools-benchmark")
        client = mlflow.MlflowClient()
        results: dict[str, dict[str, float]] = {}

        with mlflow.start_run(experiment_id=experiment, run_name="mlflow-sync") as run:
            results["mlflow_sync"] = _per_call(
                lambda i: mlflow.log_metric("loss", 1.0 / (i + 1), step=i), args.sync_calls
            )
        sync_id = run.info.run_id

        with mlflow.start_run(experiment_id=experiment, run_name="mlflow-async") as run:
            results["mlflow_async"] = _per_call(
                lambda i: mlflow.log_metric("loss", 1.0 / (i + 1), step=i, synchronous=False),
                args.async_calls,
            )
            t0 = time.perf_counter()
            mlflow.flush_async_logging()
            results["mlflow_async"]["drain_s"] = round(time.perf_counter() - t0, 3)
        async_id = run.info.run_id

        logger = MlflowLogger(experiment_name="nbtools-benchmark", run_name="nbtools")
        try:
            log = logger.log_metric
            results["nbtools"] = _per_call(lambda i: log("loss", 1.0 / (i + 1), step=i), args.calls)
            t0 = time.perf_counter()
            logger.flush()
            results["nbtools"]["drain_s"] = round(time.perf_counter() - t0, 3)
        finally:
            logger.close()

        counts = {
            name: len(client.get_metric_history(run_id, "loss"))
            for name, run_id in (
                ("mlflow_sync", sync_id),
                ("mlflow_async", async_id),
                ("nbtools", logger.run_id),
            )
        }
        del os.environ["MLFLOW_TRACKING_URI"]

    for name in ("mlflow_async", "nbtools"):  # values stored per second, queueing included
        r = results[name]
        r["stored_per_s"] = round(r["calls"] / (r["calls"] * r["mean_us"] / 1e6 + r["drain_s"]))
    nb = results["nbtools"]["mean_us"]
    line = {
        "benchmark": "tracking",
        "what": "caller-side microseconds per metric logged (training thread)",
        "store": "sqlite (MLflow's default local store), temporary",
        "mlflow": mlflow.__version__,
        "python": sys.version.split()[0],
        **results,
        "all_values_stored": counts
        == {
            "mlflow_sync": args.sync_calls,
            "mlflow_async": args.async_calls,
            "nbtools": args.calls,
        },
        "ratio_mlflow_sync_over_nbtools": round(results["mlflow_sync"]["mean_us"] / nb, 1),
        "ratio_mlflow_async_over_nbtools": round(results["mlflow_async"]["mean_us"] / nb, 1),
        "start": start,
        "goal_us": 50,
        "meets_goal": nb <= 50,
    }
    print(json.dumps(line))
    return 0 if line["all_values_stored"] else 1


if __name__ == "__main__":
    sys.exit(main())
