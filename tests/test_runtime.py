"""nbtools.runtime outside ranks, with torchrun-style environment, and inside a real group."""

from __future__ import annotations

import pytest

from nbtools import runtime
from nbtools.errors import DistributedError, NbtoolsError


def test_defaults_outside_any_run(monkeypatch):
    for var in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        monkeypatch.delenv(var, raising=False)
    assert runtime.get_rank() == 0
    assert runtime.get_local_rank() == 0
    assert runtime.get_world_size() == 1
    assert runtime.get_local_world_size() == 1
    assert runtime.get_node_rank() == 0
    assert runtime.get_restart_count() == 0
    assert runtime.is_main_process()
    assert not runtime.is_distributed()


def test_reads_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert (runtime.get_rank(), runtime.get_local_rank()) == (5, 1)
    assert (runtime.get_world_size(), runtime.get_local_world_size()) == (8, 4)
    assert runtime.get_node_rank() == 1
    assert runtime.get_restart_count() == 2
    assert not runtime.is_main_process()


def test_bad_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        runtime.get_world_size()


def test_initialised_group_wins_over_environment(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert runtime.is_distributed()
        assert runtime.get_rank() == 0
        assert runtime.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_error_hierarchy():
    err = DistributedError("rank 1 failed", {1: "x"})
    assert isinstance(err, NbtoolsError) and isinstance(err, RuntimeError)
    assert err.failures == {1: "x"}
