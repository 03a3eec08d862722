"""What a launch leaves outside its ranks ends with it: the launch-end hooks."""

from __future__ import annotations

import pytest

from nbtools import distributed
from nbtools._internal import hooks
from nbtools.errors import DistributedError


@pytest.fixture
def snapshots(tmp_path, monkeypatch):
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(path))
    return path


@pytest.mark.slow
def test_memory_snapshots_of_a_launch_that_failed_for_good_are_dropped(tmp_path, snapshots):
    # A manager closed by an exception keeps its snapshots for a restart
    # (tests/checkpoint/test_memory_tier.py); a launch that failed past max_restarts
    # has no restart left, so the launcher drops them on this node.
    @distributed(processes=2, max_restarts=0, output="none")
    def train(root):
        import torch

        from nbtools.checkpoint import CheckpointManager

        net = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with CheckpointManager(root, every=100, memory_every=1, async_save=False) as ckpt:
            for step in range(3):
                ckpt.maybe_save(step, model=net, optimizer=opt)
            assert any(
                f.endswith(".slot")
                for _, _, fs in __import__("os").walk(
                    __import__("os").environ["NBTOOLS_SNAPSHOT_DIR"]
                )
                for f in fs
            )
            raise RuntimeError("the step after the snapshots failed")

    with pytest.raises(DistributedError, match="the step after the snapshots failed"):
        train.distributed(str(tmp_path / "root"))
    assert [p for p in snapshots.rglob("*") if p.is_file()] == []


def test_a_launch_end_hook_is_named_as_module_and_function():
    with pytest.raises(ValueError, match="module:function"):
        hooks.at_launch_end("no_colon_here")
