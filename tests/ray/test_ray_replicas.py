"""A lost Ray node's ranks recover from the replicas their peers hold, not from the volume.

Each rank keeps its memory snapshots in a directory of its node (the test
cluster's nodes share one machine, so each node gets a directory of its own,
as each real node has its own memory); with more than one node every rank's
snapshot is also held by a rank on another node (``replicas`` defaults to 1).
The node of the last rank is removed mid-run and its directory with it. With
two ranks per node, the ranks of a node split their replicated tensors between
their snapshots: the lost node's new ranks each get both shares from two peers.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch

from nbtools import distributed

pytestmark = pytest.mark.slow


def _training_cell():
    """The training function, defined the way a notebook cell defines it (sent by value)."""

    def _train(base, root, gate):
        """Ranks on two nodes: snapshots every 2 steps, volume checkpoints every 5."""
        import glob
        import json
        import os
        import time

        import torch
        import torch.distributed as dist

        from nbtools import runtime
        from nbtools.checkpoint import CheckpointManager

        rank, attempt = runtime.get_rank(), runtime.get_restart_count()
        share = None
        node = os.environ["NBTOOLS_NODE_ID"]
        os.environ["NBTOOLS_SNAPSHOT_DIR"] = memory = os.path.join(base, node)
        os.makedirs(memory, exist_ok=True)
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        with CheckpointManager(root, every=5, memory_every=2) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 10):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(2, 4)).sum().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 8:  # which ranks this rank's snapshot shares tensors with
                    ckpt.wait()
                    (slot,) = [p for p in glob.glob(f"{memory}/*/*/r{rank}-*.slot")][-1:]
                    with open(slot, "rb") as fh:
                        share = json.loads(fh.read(4096)[8:])["share"]
                if attempt == 0 and step == 7:
                    ckpt.wait()  # step 6's snapshots and their replicas are complete
                    dist.barrier()
                    if rank == dist.get_world_size() - 1:
                        with open(gate + ".tmp", "w") as fh:
                            fh.write(node)
                        os.replace(gate + ".tmp", gate)
                    time.sleep(600)  # the node goes away here
        weights = [p.detach().clone() for p in net.parameters()]
        return {
            "restart": attempt,
            "restored": ckpt.restored_step,
            "tier": ckpt.restored_tier,
            "replicas": ckpt.replicas,
            "node": node,
            "share": share,
            "weights": weights,
        }

    return _train


def _reference(world):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    for step in range(10):
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(2, 4)).sum().backward()
        for p in net.parameters():
            p.grad.mul_(world)  # the all-reduce of equal gradients
        opt.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("per_node", [1, 2])
def test_a_lost_nodes_rank_restores_from_its_peers_replica(ray_cluster, tmp_path, per_node):
    base, gate = tmp_path / "memory", tmp_path / "gate"
    base.mkdir()

    def lose():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if gate.exists() and gate.read_text():
                node = gate.read_text().strip()
                ray_cluster.remove(node)
                shutil.rmtree(base / node, ignore_errors=True)  # its memory is gone with it
                return
            time.sleep(0.1)

    remover = threading.Thread(target=lose, name="node-remover")
    remover.start()
    try:
        fn = distributed(processes=2 * per_node, cluster="ray", nodes=2, max_restarts=1)(
            _training_cell()
        )
        results = fn.distributed(str(base), str(tmp_path / "root"), str(gate))
    finally:
        remover.join()
        ray_cluster.restore()
    lost = gate.read_text()
    world = 2 * per_node
    assert [r["restart"] for r in results] == [1] * world
    assert [r["replicas"] for r in results] == [1] * world  # two nodes: one replica by default
    assert lost not in {r["node"] for r in results}
    # Step 6 from memory, not step 5 from the volume; the lost node's own slots went with it.
    assert [r["restored"] for r in results] == [6] * world
    assert {r["tier"] for r in results} <= {"memory", "replica"}
    assert results[-1]["tier"] == "replica"
    # Each node's ranks shared their tensors (a node of one rank keeps them whole).
    assert [r["share"] for r in results] == [
        [r // per_node * per_node, per_node] for r in range(world)
    ]
    reference = _reference(world)
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(result["weights"], reference, strict=True))
    assert os.path.isdir(tmp_path / "root")
