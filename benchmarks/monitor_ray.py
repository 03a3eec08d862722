"""GPU pane over a Ray cluster: bytes sent to the front end per poll, per node.

A local 3-node Ray cluster on loopback (plus its head), each node running the
simulated backend with 8 GPUs in its sampler actor. The pane polls every node
through those actors; the bytes each poll sends to the browser are divided by
the number of nodes. Baseline in the same run: the same pane over one host's 8
simulated GPUs. Goal: <= 4 KB per node per poll. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nodes on 127.0.0.1 only
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from monitor import _comms  # (the byte-counting comm of benchmarks/monitor.py)

from nbtools.monitor import GPUPane, SimulatedBackend

GPUS, NODES, POLLS = 8, 3, 20


def _bytes_per_poll(comms: list, backend) -> tuple[float, int]:
    pane = GPUPane(backend=backend, interval=3600, idle_timeout=None, display=False)
    try:
        hosts = len(pane.sampler.samples.hosts())
        pane.refresh()  # the first poll may carry a new host's figure; measure steady polls
        before = sum(sum(c.sizes) for c in comms)
        for _ in range(POLLS):
            pane.refresh()
        return (sum(sum(c.sizes) for c in comms) - before) / POLLS, hosts
    finally:
        pane.close()


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from nbtools.monitor.cluster import ClusterBackend

    comms = _comms()
    local, _ = _bytes_per_poll(comms, SimulatedBackend(GPUS))
    temp = f"/tmp/nbtools-ray-bench-{os.getpid()}"
    os.environ["RAY_TMPDIR"] = temp
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        for _ in range(NODES):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        per_poll, hosts = _bytes_per_poll(comms, ClusterBackend(simulated=GPUS))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    per_node = per_poll / hosts
    print(
        json.dumps(
            {
                "benchmark": "monitor_ray",
                "nodes": hosts,
                "gpus_per_node": GPUS,
                "cluster_bytes_per_poll": round(per_poll),
                "cluster_bytes_per_node_per_poll": round(per_node),
                "one_host_bytes_per_poll": round(local),
                "per_node_vs_one_host": round(per_node / local, 2),
                "goal_per_node_le_4kb": per_node <= 4096,
            }
        )
    )


if __name__ == "__main__":
    main()
