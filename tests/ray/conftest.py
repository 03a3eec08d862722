"""A real Ray cluster on this machine for the tests of ``cluster="ray"``.

One cluster for the whole session (starting one takes tens of seconds on a
small machine): a head without CPUs, so no rank lands there, and three nodes
with 2 CPUs each. Every node listens on 127.0.0.1 only.

``no_leaks`` is extended for Ray: Ray's own processes (raylets, idle
workers) belong to the cluster, not to a test, but a test that leaves an
nbtools actor alive, a placement group not removed, or such an actor's
process running fails.
"""

from __future__ import annotations

import os
import shutil
import time

import psutil
import pytest

# Read when Ray is imported: without it every node binds to the machine's outward-facing
# address instead of the node_ip_address given below.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray puts its sockets under its temporary directory; a test session's own TMPDIR can make
# those paths longer than a Unix socket allows. A short one, removed when the cluster stops.
_RAY_TMP = f"/tmp/nbtools-ray-{os.getpid()}"

ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "nbtools[ray]"')

from _leaks import env_problems, process_group_problems  # noqa: E402
from _ray_helpers import our_processes, wait_until_clean  # noqa: E402

WORKER_NODES = 3
CPUS_PER_NODE = 2
_NODE_ARGS = {"num_cpus": CPUS_PER_NODE, "node_ip_address": "127.0.0.1"}


class _RayCluster:
    """The test cluster and what tests may do with it (lose a node, get it back)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        for _ in range(WORKER_NODES):
            self.cluster.add_node(**_NODE_ARGS)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def worker_nodes(self) -> list:
        return [n for n in self.cluster.list_all_nodes() if n is not self.cluster.head_node]

    def remove(self, node_id: str) -> None:
        """Lose the node with this Ray node id (its processes die at once)."""
        for node in self.worker_nodes():
            if node.node_id == node_id:
                self.cluster.remove_node(node, allow_graceful=False)
                return
        raise AssertionError(f"no worker node has id {node_id}")

    def restore(self) -> None:
        """Add nodes until the cluster has its worker nodes again."""
        while len(self.worker_nodes()) < WORKER_NODES:
            self.cluster.add_node(**_NODE_ARGS)
        self.cluster.wait_for_nodes()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
            if len(alive) >= WORKER_NODES:
                return
            time.sleep(0.2)

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _start_cluster(attempts: int = 5) -> _RayCluster:
    """Start the cluster, again from nothing if a node timed out registering.

    Ray gives a starting node a fixed 30 s to register with the head, whatever
    ``RAY_raylet_start_wait_time_s`` says; on a busy 2-core machine a node can
    take longer. A failed start is ended whole: every process under this
    session's Ray directory is killed, so nothing half-started stays behind.
    """
    for attempt in range(attempts):
        try:
            return _RayCluster()
        except Exception as exc:  # Ray raises a bare Exception for this
            started = [proc for proc in psutil.process_iter(["cmdline"])
                       if _RAY_TMP in " ".join(proc.info["cmdline"] or ())]
            for proc in started:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(started, timeout=10)
            shutil.rmtree(_RAY_TMP, ignore_errors=True)
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster, with this process connected as its driver."""
    before = set(os.environ)
    os.environ["RAY_TMPDIR"] = _RAY_TMP  # read by every Ray process the cluster starts
    cluster = _start_cluster()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for name in set(os.environ) - before:
            if name.startswith("RAY_") and name != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER":
                del os.environ[name]
        shutil.rmtree(_RAY_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """The shared leak checks, minus Ray's own processes, plus actors and placement groups.

    Replaces the top-level ``no_leaks`` for these tests: the cluster's
    processes are this process's children and Ray starts and ends idle
    workers as it pleases.
    """
    import tempfile

    env_before = dict(os.environ)
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    yield
    # Ray's state is only asked about when the test used the cluster.
    problems = wait_until_clean() if "ray_cluster" in request.fixturenames else []
    new_tmp = sorted(
        e for e in set(os.listdir(tempfile.gettempdir())) - tmp_before
        if not e.startswith(("pytest-", "pymp-", "ray"))
    )
    if new_tmp:
        problems.append(f"temporary files left in {tempfile.gettempdir()}: {new_tmp[:10]}")
    for proc in our_processes():
        proc.kill()
    problems += env_problems(env_before, {"PYTEST_CURRENT_TEST"})
    problems += process_group_problems()
    import threading

    leftover = [t.name for t in threading.enumerate() if t.name.startswith("nbtools")]
    if leftover:
        problems.append(f"nbtools threads left running: {leftover}")
    if problems:
        pytest.fail("LEAK: " + "; ".join(problems), pytrace=False)
