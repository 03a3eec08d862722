"""``@distributed(cluster="ray")`` on a real local Ray cluster: placement, output, failures."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _ray_helpers import live_placement_groups, wait_until_clean

from nbtools import DistributedError, distributed

pytestmark = pytest.mark.slow


def test_four_ranks_over_two_nodes(ray_cluster):
    @distributed(
        processes=4,
        cluster="ray",
        nodes=2,
        runtime_env={"env_vars": {"NBTOOLS_TEST_FLAG": "from-runtime-env"}},
    )
    def where(scale):
        import os

        import torch
        import torch.distributed as dist

        from nbtools import runtime
        from nbtools.launch._ray import _ray_compat

        class Cell:  # a class defined where the function is, as in a notebook cell
            def __init__(self, value):
                self.value = value

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        names = (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "NODE_RANK",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "NBTOOLS_NODE_ID",
            "NBTOOLS_TEST_FLAG",
        )
        return {
            "env": {n: os.environ.get(n) for n in names},
            "sum": Cell(t.item() * scale).value,
            "runtime": (
                runtime.get_rank(),
                runtime.get_local_rank(),
                runtime.get_world_size(),
                runtime.get_local_world_size(),
                runtime.get_node_rank(),
            ),
            "backend": dist.get_backend(),
            "session": _ray_compat.session_dir(),  # where the rank's scratch files go
        }

    results = where.distributed(2)
    assert [r["env"]["RANK"] for r in results] == ["0", "1", "2", "3"]
    assert all(r["sum"] == 20.0 for r in results)  # (1+2+3+4) * 2
    assert all(r["backend"] == "gloo" for r in results)
    sessions = {r["session"] for r in results}
    assert len(sessions) == 1 and "session" in os.path.basename(str(sessions.pop()))
    nodes = [r["env"]["NBTOOLS_NODE_ID"] for r in results]
    # Exactly two nodes, ranks grouped by node in order: 0,1 on one, 2,3 on the other.
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert [r["env"]["NODE_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert [r["env"]["GROUP_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert [r["env"]["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in results} == {"2"}
    assert {r["env"]["MASTER_ADDR"] for r in results} == {"127.0.0.1"}
    assert {r["env"]["NBTOOLS_TEST_FLAG"] for r in results} == {"from-runtime-env"}
    assert [r["runtime"] for r in results] == [
        (0, 0, 4, 2, 0),
        (1, 1, 4, 2, 0),
        (2, 0, 4, 2, 1),
        (3, 1, 4, 2, 1),
    ]


class _Tee(io.TextIOBase):
    """A stream that keeps what is written and tells waiters."""

    def __init__(self) -> None:
        self.text = ""
        self.changed = threading.Condition()

    def write(self, s: str) -> int:
        with self.changed:
            self.text += s
            self.changed.notify_all()
        return len(s)

    def flush(self) -> None:
        pass

    def wait_for(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while needle not in self.text:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True


def test_output_is_live_prefixed_and_not_deduplicated(ray_cluster, tmp_path, monkeypatch):
    gate = str(tmp_path / "gate")

    @distributed(processes=4, cluster="ray", nodes=2)
    def chatty(gate):
        import os
        import sys
        import time

        rank = int(os.environ["RANK"])
        for _ in range(3):
            print("the same line on every rank")
        print(f"to stderr from {rank}", file=sys.stderr)
        if rank == 0:
            print("waiting for the gate", flush=True)
            deadline = time.time() + 120
            while not os.path.exists(gate):  # opened only once the line above was seen
                if time.time() > deadline:
                    raise RuntimeError("output did not reach the caller while the rank ran")
                time.sleep(0.05)
        return rank

    out, err = _Tee(), _Tee()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)

    def open_gate():
        if out.wait_for("[rank 0] waiting for the gate", 180):
            open(gate, "w").close()

    opener = threading.Thread(target=open_gate, name="gate-opener")
    opener.start()
    try:
        assert chatty.distributed(gate) == [0, 1, 2, 3]
    finally:
        open(gate, "a").close()
        opener.join()
    lines = out.text.splitlines()
    for rank in range(4):
        assert lines.count(f"[rank {rank}] the same line on every rank") == 3
        assert f"[rank {rank}] to stderr from {rank}" in err.text.splitlines()
    assert "repeated" not in out.text and "pid=" not in out.text


def test_exception_while_peers_wait_in_a_collective(ray_cluster):
    @distributed(processes=3, cluster="ray")
    def fails():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("bad batch on rank 1")
        dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, which never comes
        return "unreachable"

    with pytest.raises(DistributedError) as info:
        fails.distributed()
    err = info.value
    assert set(err.failures) == {1}
    failure = err.failures[1]
    assert failure.exc_type == "ValueError" and failure.message == "bad batch on rank 1"
    assert "raise ValueError" in failure.traceback
    assert failure.node and "127.0.0.1" in failure.node
    assert f"rank 1 on {failure.node} failed: ValueError: bad batch on rank 1" in str(err)


def test_killed_actor_is_reported(ray_cluster, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()

    @distributed(processes=2, cluster="ray")
    def sleeper(where):
        import os
        import time

        open(os.path.join(where, os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(600)

    def kill_rank_1():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (pids / "1").exists():
            time.sleep(0.1)
        time.sleep(0.2)
        os.kill(int((pids / "1").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, name="killer")
    killer.start()
    try:
        with pytest.raises(DistributedError) as info:
            sleeper.distributed(str(pids))
    finally:
        killer.join()
    failure = info.value.failures[1]
    assert failure.exc_type == "ActorDied"
    assert "died" in failure.message and failure.node
    assert set(info.value.failures) == {1}  # rank 0 was stopped, not reported as failed


def test_bad_requests_fail_before_anything_starts(ray_cluster):
    def fn():
        return 1

    with pytest.raises(ValueError, match=r"needs 7 CPUs .* the Ray cluster has 6: 2 on "):
        distributed(processes=7, cluster="ray")(fn).distributed()
    with pytest.raises(ValueError, match="nodes=3 is more than the 2 ranks"):
        distributed(processes=2, cluster="ray", nodes=3)(fn).distributed()
    with pytest.raises(ValueError, match="nodes=4 asks for 4 nodes"):
        distributed(processes=4, cluster="ray", nodes=4)(fn).distributed()
    with pytest.raises(ValueError, match=r"gpus=1 needs 1 GPUs .* has 0"):
        distributed(gpus=1, cluster="ray")(fn).distributed()
    with pytest.raises(ValueError, match="cluster must be None or 'ray'"):
        distributed(processes=2, cluster="slurm")
    with pytest.raises(ValueError, match="nodes= needs cluster="):
        distributed(processes=2, nodes=2)
    assert live_placement_groups() == []


def _script(body: str, tmp_path) -> list[str]:
    path = tmp_path / "driver.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_no_ray_and_no_cluster_are_clear_errors(tmp_path):
    no_ray = _script(
        """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        from nbtools import distributed
        try:
            distributed(processes=2, cluster="ray")(lambda: 1).distributed()
        except ImportError as exc:
            print("ERROR", exc)
        """,
        tmp_path,
    )
    out = subprocess.run(no_ray, capture_output=True, text=True, timeout=120)
    assert 'pip install "nbtools[ray]"' in out.stdout, out.stderr
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1")
    no_cluster = _script(
        """
        from nbtools import distributed
        from nbtools.errors import LaunchError
        try:
            distributed(processes=2, cluster="ray")(lambda: 1).distributed()
        except LaunchError as exc:
            print("ERROR", exc)
        """,
        tmp_path,
    )
    out = subprocess.run(no_cluster, capture_output=True, text=True, timeout=180, env=env)
    assert "ERROR no Ray cluster is reachable at '127.0.0.1:1'" in out.stdout, out.stderr


@pytest.mark.usefixtures("sigint_default")
def test_sigint_to_the_caller_removes_every_actor(ray_cluster, tmp_path):
    driver = _script(
        f"""
        import sys, ray
        ray.init(address={ray_cluster.address!r}, log_to_driver=False)
        from nbtools import distributed

        @distributed(processes=2, cluster="ray")
        def forever():
            import time
            print("running", flush=True)
            time.sleep(600)

        try:
            forever.distributed()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        sys.stdin.read()  # stay connected: Ray must not be what cleans up
        """,
        tmp_path,
    )
    proc = subprocess.Popen(
        driver, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[rank 1] running") or line.startswith("[rank 0] running"):
                if sum("running" in s for s in seen) == 2:
                    break
        assert sum("running" in s for s in seen) == 2, "".join(seen)
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == "interrupted":
                break
        assert seen[-1].strip() == "interrupted", "".join(seen)
        assert wait_until_clean(timeout=15) == []
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()


CELL_FUNCTIONS = """
import multiprocessing

def cube(x):  # a function of a cell: lives in __main__, travels by value
    return x ** 3

def by_reference():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.map(cube, range(3))
"""


def test_cell_functions_resolve_by_reference_in_ray_ranks(ray_cluster):
    namespace = {"__name__": "__main__"}
    exec(compile(CELL_FUNCTIONS, "<cell>", "exec"), namespace)  # a test's own cell
    fn = distributed(processes=2, cluster="ray", output="none")(namespace["by_reference"])
    assert fn.distributed() == [[0, 1, 8], [0, 1, 8]]
