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


@pytest.mark.parametrize(("world", "global_batch"), [(8, 512), (7, 512), (5, 13), (3, 3), (1, 9)])
def test_batch_plan_shares_sum_to_the_global_batch_and_differ_by_at_most_one(world, global_batch):
    plans = [runtime.batch_plan(global_batch, world_size=world, rank=r) for r in range(world)]
    shares = plans[0].shares
    assert sum(shares) == global_batch and max(shares) - min(shares) <= 1
    extra = global_batch % world
    assert [s > global_batch // world for s in shares] == [r < extra for r in range(world)]
    assert [p.local_batch_size for p in plans] == list(shares)
    assert [p.offset for p in plans] == [sum(shares[:r]) for r in range(world)]
    assert all(p.loss_scale == world / global_batch for p in plans)


def test_batch_plan_describes_the_shares_as_the_cell_says_them():
    assert runtime.batch_plan(512, world_size=7, rank=6).describe() == "74 or 73 samples per rank"
    assert runtime.batch_plan(512, world_size=8, rank=0).describe() == "64 samples per rank"


def test_batch_plan_reads_the_world_from_the_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    plan = runtime.batch_plan(10)
    assert (plan.world_size, plan.rank, plan.shares, plan.local_batch_size) == (3, 2, (4, 3, 3), 3)


def test_batch_plan_refuses_a_global_batch_smaller_than_the_world():
    with pytest.raises(ValueError, match="global batch of 3 samples cannot be split over 4 ranks"):
        runtime.batch_plan(3, world_size=4, rank=0)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        runtime.batch_plan(8, world_size=4, rank=4)
    with pytest.raises(TypeError, match="global_batch_size must be an integer"):
        runtime.batch_plan(8.0, world_size=4, rank=0)  # type: ignore[arg-type]
