"""The one local Ray cluster of a test process, shared by the Ray tests and notebook 06.

A head without CPUs, so no rank lands there, and three nodes with 2 CPUs
each, every one listening on 127.0.0.1 only. It starts on first use
(:func:`shared`) and stops when the session leaves the tests that use it (:func:`stop`,
called by the root ``conftest.py``), or at the session's end: a second cluster on a busy
2-core machine would slow both past their start timeouts, and an idle one left running
takes a core's share and 1.3 GB from the tests after it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import threading
import time

import psutil

# Read when Ray is imported: without it every node binds to the machine's outward-facing
# address instead of the node_ip_address given below.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray

#: Ray puts its sockets under its temporary directory; a test session's own TMPDIR can make
#: those paths longer than a Unix socket allows. A short one, removed when the cluster stops.
RAY_TMP = f"/tmp/nbtools-ray-{os.getpid()}"
WORKER_NODES = 3
CPUS_PER_NODE = 2
_NODE_ARGS = {"num_cpus": CPUS_PER_NODE, "node_ip_address": "127.0.0.1"}
#: How long one try at starting the cluster may take before its processes are killed.
#: A start takes about 10 s here; a try that hangs in a call to an overloaded GCS is
#: turned into an error (Ray's own calls give up about 30 s after the GCS is gone).
_TRY_DEADLINE_S = 90.0
_TRIES = 3
#: How the head finds a node gone: a health check every half second, and a node that fails
#: six in a row (each may take Ray's 10 s to time out) is dead. Ray's defaults, every 3 s and
#: five failures, make each test that loses a node wait some 15 s for Ray to say so; a live
#: node of a busy machine still answers within the timeout.
_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 6}


class RayCluster:
    """The test cluster and what tests may do with it (lose a node, get it back)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                "_system_config": dict(_HEALTH_CHECKS),  # Ray adds its own keys to it
            },
        )
        # The nodes start side by side; then every one of them is waited for.
        for _ in range(WORKER_NODES):
            self.cluster.add_node(wait=False, **_NODE_ARGS)
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
            self.cluster.add_node(wait=False, **_NODE_ARGS)
        self.cluster.wait_for_nodes()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
            if len(alive) >= WORKER_NODES:
                return
            time.sleep(0.2)

    def shutdown(self) -> None:
        self.cluster.shutdown()


_cluster: RayCluster | None = None
_env_before: set[str] = set()


def _kill_started() -> None:
    """Kill every process under this session's Ray directory, and the directory."""
    started = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if RAY_TMP in " ".join(proc.info["cmdline"] or ()):
                started.append(proc)
        except psutil.Error:
            continue
    for proc in started:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(started, timeout=10)
    shutil.rmtree(RAY_TMP, ignore_errors=True)


def _kill_hung(fired: threading.Event) -> None:
    fired.set()
    _kill_started()


def _start() -> RayCluster:
    """Start the cluster, again from nothing if a try timed out or hung.

    Ray gives a starting node a fixed 30 s to register with the head, whatever
    ``RAY_raylet_start_wait_time_s`` says, and a call to an overloaded GCS can
    block for minutes; on a busy 2-core machine either can happen. A try that
    takes longer than :data:`_TRY_DEADLINE_S` has its processes killed, which
    makes the blocked call fail; a failed try is ended whole, so nothing
    half-started stays behind.
    """
    for attempt in range(1, _TRIES + 1):
        fired = threading.Event()
        watchdog = threading.Timer(_TRY_DEADLINE_S, _kill_hung, args=(fired,))
        watchdog.daemon = True
        watchdog.start()
        try:
            cluster = RayCluster()
        except Exception as exc:  # Ray raises a bare Exception for a node's timeout
            watchdog.cancel()
            watchdog.join()
            _kill_started()
            if attempt == _TRIES or not (fired.is_set() or "timed out" in str(exc).lower()):
                raise
            continue
        watchdog.cancel()
        watchdog.join()
        if fired.is_set():  # killed just as it started
            _kill_started()
            continue
        return cluster
    raise AssertionError(f"the test Ray cluster did not start in {_TRIES} tries")


@contextlib.contextmanager
def keeping_sigterm():
    """Give SIGTERM back its handler after Ray's C++ code installed its own.

    Ray's failure-signal handler (it logs "SIGTERM received" and dumps a stack)
    is inherited by every process this one forks later, such as a
    ``multiprocessing`` pool of another test: terminating that pool then takes
    seconds, and can deadlock in the handler's logging in the forked child.
    """
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def shared() -> RayCluster:
    """This process's cluster, started on first use (``RAY_TMPDIR`` is set while it runs)."""
    global _cluster, _env_before
    if _cluster is None:
        _env_before = set(os.environ)
        os.environ["RAY_TMPDIR"] = RAY_TMP  # read by every Ray process the cluster starts
        with keeping_sigterm():
            _cluster = _start()
    return _cluster


def started() -> bool:
    """Whether :func:`shared` started a cluster that is still running."""
    return _cluster is not None


#: How long stopping the cluster may take before its processes are killed. Ray's shutdown
#: waits in its C++ core on calls to the GCS, where no Python signal (pytest-timeout's
#: included) reaches it; killing the cluster's processes makes those calls fail.
_STOP_DEADLINE_S = 60.0


def stop() -> None:
    """Stop the cluster if one was started; remove what it set and wrote.

    Bounded: a stop that takes longer than :data:`_STOP_DEADLINE_S` has the cluster's
    processes killed, and says so with the stack it was blocked in.
    """
    global _cluster
    if _cluster is None:
        return
    cluster, _cluster = _cluster, None
    fired = threading.Event()

    def hung() -> None:
        fired.set()
        sys.stderr.write(
            f"\nthe test Ray cluster did not stop in {_STOP_DEADLINE_S:.0f} s; killing its "
            "processes. Where it was blocked:\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _kill_started()

    watchdog = threading.Timer(_STOP_DEADLINE_S, hung)
    watchdog.daemon = True
    watchdog.start()
    try:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    finally:
        watchdog.cancel()
        for name in set(os.environ) - _env_before:
            if name == "PYTHONBREAKPOINT" or (  # set by ray.init for its debugger
                name.startswith("RAY_") and name != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
            ):
                del os.environ[name]
        _kill_started()
