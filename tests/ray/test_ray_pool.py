"""``RankPool(cluster="ray")``: ranks that stay alive between calls, on Ray actors over two nodes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from _ray_helpers import live_placement_groups

from nbtools import DistributedError
from nbtools.launch import RankPool

pytestmark = pytest.mark.slow


def test_a_pool_on_two_nodes_keeps_its_state_and_group_between_calls(ray_cluster):
    with RankPool(processes=4, cluster="ray", nodes=2, output="none") as pool:
        assert pool.world_size == 4
        pool.execute(
            "import os, torch, torch.distributed as dist\n"
            "node = os.environ['NBTOOLS_NODE_ID']\n"
            "w = torch.full((2,), float(dist.get_rank() + 1))"
        )
        pool.push(scale=10.0)

        def reduce_scaled():  # a function as a cell defines it: sent by value
            import torch.distributed as dist

            t = w * scale  # noqa: F821 - names of the pool's namespace
            dist.all_reduce(t)
            return t.tolist()

        reduce_scaled.__module__ = "__main__"  # as for a function of a notebook cell
        assert pool.run(reduce_scaled) == [[100.0, 100.0]] * 4  # (1+2+3+4) * 10
        nodes = pool.pull("node")
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
        assert pool.execute("int(os.environ['NODE_RANK'])") == [0, 0, 1, 1]

        with pytest.raises(DistributedError, match="ValueError: bad on rank 2"):
            pool.execute("if dist.get_rank() == 2:\n    raise ValueError('bad on rank 2')")
        # A failure in user code keeps the ranks and their state.
        assert pool.restarts == 0
        assert pool.execute("w.sum().item()") == [2.0, 4.0, 6.0, 8.0]
        # Fresh ranks on request: the ranks that ended well make room for them at once.
        pids = pool.pids
        pool.restart()
        assert set(pool.pids).isdisjoint(pids)
        assert pool.execute("'w' in globals()") == [False] * 4
    assert pool.closed
    assert live_placement_groups() == []


def test_a_rank_that_dies_on_ray_is_replaced_by_fresh_actors(ray_cluster):
    with RankPool(processes=2, cluster="ray", max_restarts=1, output="none") as pool:
        pool.execute("import os, torch.distributed as dist\nx = 1")
        pids = pool.pids
        with pytest.raises(DistributedError) as info:
            pool.execute("if dist.get_rank() == 1:\n    os._exit(3)\ndist.barrier()")
        message = str(info.value)
        assert message.startswith("rank 1 on ") and "its actor process died" in message, message
        assert "restarted with 2 fresh ranks" in message, message
        assert set(pool.pids).isdisjoint(pids) and pool.restarts == 1
        with pytest.raises(DistributedError, match="NameError"):
            pool.execute("x")  # the state went with the old ranks
        assert pool.execute("import torch.distributed as dist\ndist.get_world_size()") == [2, 2]
    assert live_placement_groups() == []


def test_rank_zeros_store_listens_on_the_node_address_only(ray_cluster):
    with RankPool(processes=2, cluster="ray", output="none") as pool:
        listening = pool.execute(
            "import os, psutil\n"
            "port = int(os.environ['MASTER_PORT'])\n"
            "sorted({c.laddr.ip for c in psutil.Process().net_connections('tcp')\n"
            "        if c.status == psutil.CONN_LISTEN and c.laddr.port == port})"
        )
        address = pool.execute("os.environ['MASTER_ADDR']")[0]
    assert listening[0] == [address], listening  # rank 0 hosts the store: not 0.0.0.0 or ::
    assert live_placement_groups() == []


def _when_written(path, action) -> threading.Thread:
    def wait():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if path.exists() and path.read_text():
                action(path.read_text().strip())
                return
            time.sleep(0.05)

    thread = threading.Thread(target=wait, name="test-trigger")
    thread.start()
    return thread


@pytest.mark.usefixtures("sigint_default")
def test_an_interrupt_on_ray_ranks_stops_python_code_and_says_what_it_cannot_stop(
    ray_cluster, tmp_path, caplog
):
    marker = tmp_path / "started"
    with RankPool(processes=2, cluster="ray", output="none") as pool:
        pool.execute("import time\nx = 1")
        pids = pool.pids
        cell = (
            f"if dist.get_rank() == 0:\n    open({str(marker)!r}, 'w').write('go')\n"
            "deadline = time.monotonic() + 600\n"
            "while time.monotonic() < deadline:\n    sum(range(1000))\n"
        )
        pool.execute("import torch.distributed as dist")
        thread = _when_written(marker, lambda _: os.kill(os.getpid(), signal.SIGINT))
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.execute(cell)
        finally:
            thread.join()
        assert pool.pids == pids and pool.pull("x") == [1, 1]  # Python code stopped: state kept

        # time.sleep in the actor thread ends at the interrupt, as in the kernel: state kept.
        marker.unlink()
        thread = _when_written(marker, lambda _: os.kill(os.getpid(), signal.SIGINT))
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.execute(
                    f"if dist.get_rank() == 0:\n    open({str(marker)!r}, 'w').write('go')\n"
                    "time.sleep(600)"
                )
        finally:
            thread.join()
        assert pool.pids == pids and pool.pull("x") == [1, 1]
        assert pool.execute("time.sleep(0.01)\n2") == [2, 2]  # sleeps still sleep afterwards

        # A wait no interrupt reaches in a thread: the ranks are replaced, and the message
        # says what to write instead.
        marker.unlink()
        thread = _when_written(marker, lambda _: os.kill(os.getpid(), signal.SIGINT))
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.execute(
                    "import threading\n"
                    f"if dist.get_rank() == 0:\n    open({str(marker)!r}, 'w').write('go')\n"
                    "threading.Event().wait(600)"
                )
        finally:
            thread.join()
        assert "actor thread" in caplog.text and "event.wait(0.5)" in caplog.text, caplog.text
        assert pool.execute("1") == [1, 1]
    assert live_placement_groups() == []


def test_a_node_lost_during_a_pool_call_is_named(ray_cluster, tmp_path):
    marker = tmp_path / "node"
    try:
        with RankPool(processes=2, cluster="ray", nodes=2, output="none") as pool:
            pool.execute("import os, time\nimport torch.distributed as dist")
            thread = _when_written(marker, ray_cluster.remove)
            try:
                with pytest.raises(DistributedError) as info:
                    pool.execute(
                        f"if dist.get_rank() == 1:\n"
                        f"    open({str(marker)!r}, 'w').write(os.environ['NBTOOLS_NODE_ID'])\n"
                        "time.sleep(600)"
                    )
            finally:
                thread.join()
            message = str(info.value)
            lost = marker.read_text().strip()
            assert "NodeLost" in message or "its node was lost" in message, message
            assert lost[:8] in message, message
            assert "actor process died" not in message, message
            assert info.value.failures[1].exc_type == "NodeLost"
    finally:
        ray_cluster.restore()
    assert live_placement_groups() == []
