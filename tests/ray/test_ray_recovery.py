"""A lost node on a Ray cluster: the group restarts on the other nodes and resumes exactly.

The test loses one of the cluster's worker nodes (``Cluster.remove_node``)
while ranks train on it, and gives the cluster a new node afterwards.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from nbtools import distributed
from nbtools._demo.samples import make_volume

pytestmark = pytest.mark.slow


def _lose_node_when(marker, ray_cluster, timeout=240.0):
    """A thread that removes the node whose id the ranks wrote into ``marker``."""

    def lose():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                ray_cluster.remove(marker.read_text().strip())
                return
            time.sleep(0.1)

    return threading.Thread(target=lose, name="node-remover")


def _training_cell():
    """The training function, defined the way a notebook cell defines it (sent by value)."""

    def _train(volume, root, pause_after, gate):
        """A training cell: DDP over VolumeDataset data, checkpointed every 2 steps."""
        import os
        import time

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from nbtools import runtime
        from nbtools._demo.samples import FEATURES, DecodedSamples
        from nbtools.checkpoint import CheckpointManager
        from nbtools.data import DataLoader, VolumeDataset

        rank, attempt = runtime.get_rank(), runtime.get_restart_count()
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        model = DistributedDataParallel(net)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        node = os.environ.get("NBTOOLS_NODE_ID", "local")
        files = VolumeDataset(
            volume, shuffle=True, seed=0, cache_dir=os.path.join(root, "cache", node)
        )
        loader = DataLoader(DecodedSamples(files), batch_size=4, num_workers=0)
        total = 2 * len(files) // (4 * runtime.get_world_size())
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        staging = os.path.join(root, "staging", node, str(rank))
        with CheckpointManager(
            os.path.join(root, "ckpt"), every=2, keep=2, staging_dir=staging
        ) as ckpt:
            step = ckpt.restore(**state)
            restored = ckpt.restored_step
            while step < total:
                for _ids, x, y in loader:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    ckpt.maybe_save(step, **state)
                    if attempt == 0 and step == pause_after:
                        ckpt.wait()  # checkpoint pause_after is complete on every rank
                        dist.barrier()
                        if rank == 1:
                            with open(gate + ".tmp", "w") as fh:
                                fh.write(node)
                            os.replace(gate + ".tmp", gate)
                        time.sleep(600)  # the node goes away here
                    step += 1
                    if step >= total:
                        break
        loader.close()
        params = {k: v.detach().clone() for k, v in net.state_dict().items()}
        return {"restart": attempt, "restored": restored, "params": params, "node": node}

    return _train


def test_training_resumes_after_a_lost_node_like_an_uninterrupted_run(ray_cluster, tmp_path):
    volume = tmp_path / "volume"
    make_volume(volume, 32)
    gate = tmp_path / "gate"
    remover = _lose_node_when(gate, ray_cluster)
    remover.start()
    try:
        recovered = distributed(processes=2, cluster="ray", nodes=2, max_restarts=1)(
            _training_cell()
        ).distributed(str(volume), str(tmp_path / "recovered"), 4, str(gate))
    finally:
        remover.join()
        ray_cluster.restore()
    # The uninterrupted reference: the same function, no pause, ranks on this machine.
    reference = distributed(processes=2)(_training_cell()).distributed(
        str(volume), str(tmp_path / "reference"), None, str(tmp_path / "unused")
    )
    assert [r["restart"] for r in recovered] == [1, 1]
    assert [r["restored"] for r in recovered] == [4, 4]
    # The group restarted on the other nodes, one rank on each (nodes=2).
    assert gate.read_text() not in {r["node"] for r in recovered}
    assert recovered[0]["node"] != recovered[1]["node"]
    assert [r["restored"] for r in reference] == [None, None]
    ours, theirs = recovered[0]["params"], reference[0]["params"]
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    torch.manual_seed(0)
    assert not torch.equal(ours["0.weight"], torch.nn.Linear(16, 8).weight)  # it trained
    assert os.path.isdir(tmp_path / "recovered" / "ckpt")
