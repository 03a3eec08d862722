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


def test_a_rank_runs_only_the_end_hooks_of_packages_its_code_imported(monkeypatch, tmp_path):
    import sys
    import types

    ran = []
    probe = types.ModuleType("_end_hook_probe")
    probe.ended = ran.append
    monkeypatch.setitem(sys.modules, probe.__name__, probe)
    # An importable package the rank's code never imported: its hook would say it ran.
    (tmp_path / "_end_hook_unused.py").write_text(
        "def ended(run_id):\n    raise SystemExit(run_id)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hooks, "_AT_END", [f"{probe.__name__}:ended", "_end_hook_unused:ended"])
    hooks.launch_ended("run-1", imported_only=True)
    assert ran == ["run-1"]
    assert "_end_hook_unused" not in sys.modules
    with pytest.raises(SystemExit, match="run-2"):
        hooks.launch_ended("run-2")  # all of them: that one is imported and called
    sys.modules.pop("_end_hook_unused", None)
