"""A Ray launch that ended for good leaves nothing of its memory snapshots on its nodes.

Its last attempt ends as lost nodes end one: every rank dies at once and no
manager closes, so what the ranks held stays on their nodes unless the
launcher's end removes it there.

The ranks keep their snapshots in a directory their ``runtime_env`` names, which
the launching process's own environment does not: only the clean-up that runs
on the ranks' nodes, with their environment, can find them. (The test cluster's
nodes share this machine, and so one directory.)
"""

from __future__ import annotations

import pytest

from nbtools import distributed
from nbtools.errors import DistributedError

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def _training_cell():
    """The function, defined the way a notebook cell defines it (sent by value)."""

    def snapshot_then_fail(root):
        import os

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager

        net = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with CheckpointManager(root, every=100, memory_every=1, async_save=False) as ckpt:
            for step in range(3):
                ckpt.maybe_save(step, model=net, optimizer=opt)
            ckpt.wait()
            held = [f for _, _, fs in os.walk(os.environ["NBTOOLS_SNAPSHOT_DIR"]) for f in fs]
            assert any(f.endswith(".slot") for f in held), held
            dist.barrier()  # every rank has snapshotted
            os._exit(3)  # every rank dies at once: no manager closes anywhere

    return snapshot_then_fail


def test_a_launch_failed_past_its_restarts_leaves_no_snapshot_on_its_nodes(ray_cluster, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    train = distributed(
        processes=3,
        cluster="ray",
        nodes=3,
        max_restarts=0,
        output="none",
        runtime_env={"env_vars": {"NBTOOLS_SNAPSHOT_DIR": str(shm)}},
    )(_training_cell())
    with pytest.raises(DistributedError, match=r"rank \d"):
        train.distributed(str(tmp_path / "root"))
    assert [str(p) for p in shm.rglob("*")] == []


def _returning_cell():
    """A function that keeps its snapshots at its return (no manager closes) and adds a
    launch-end hook of its own in its process, which names the process it ran in."""

    def snapshot_and_return(root, seen):
        import os
        import sys
        import types

        import torch

        from nbtools._internal import hooks
        from nbtools.checkpoint import CheckpointManager

        probe = types.ModuleType("_launch_end_probe")

        def ended(run_id):
            with open(os.path.join(seen, str(os.getpid())), "w") as fh:
                fh.write(run_id)

        probe.ended = ended
        sys.modules[probe.__name__] = probe
        hooks.at_launch_end(f"{probe.__name__}:ended")
        net = torch.nn.Linear(8, 8)
        ckpt = CheckpointManager(root, every=100, memory_every=1, async_save=False)
        ckpt.maybe_save(0, model=net)
        ckpt.wait()
        return os.getpid()

    return snapshot_and_return


def test_a_launch_that_returned_ends_its_snapshots_in_a_rank_process_on_each_node(
    ray_cluster, tmp_path
):
    shm, seen = tmp_path / "shm", tmp_path / "seen"
    shm.mkdir()
    seen.mkdir()
    train = distributed(
        processes=2,
        cluster="ray",
        nodes=2,
        output="none",
        runtime_env={"env_vars": {"NBTOOLS_SNAPSHOT_DIR": str(shm)}},
    )(_returning_cell())
    pids = train.distributed(str(tmp_path / "root"), str(seen))
    # The hooks ran in the process of each rank (one on each node): no other worker.
    assert sorted(int(p.name) for p in seen.iterdir()) == sorted(pids)
    assert [str(p) for p in shm.rglob("*")] == []
