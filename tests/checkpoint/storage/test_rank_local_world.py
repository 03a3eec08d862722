"""A rank-local checkpoint loaded with another world size says why, in the error the user sees."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools import distributed
from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.checkpoint._storage._rank_local import check_rank_local
from nbtools.checkpoint._storage._target import open_target
from nbtools.errors import DistributedError
from nbtools.launch import _env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_rank_local(tmp_path_factory):
    """A checkpoint saved rank-local (``use_collectives=False``) by 2 ranks."""
    _env.warm_up()  # the interpreter-owned forkserver, before any per-test leak check
    path = str(tmp_path_factory.mktemp("rank_local") / "c")

    @distributed(processes=2)
    def save(path: str) -> None:
        import torch.distributed as dist

        rank = dist.get_rank()
        state = {f"rank{rank}": torch.full((3,), float(rank))}
        dcp.save(state, storage_writer=VolumeWriter(path), use_collectives=False)

    save.distributed(path)
    assert sorted(os.listdir(path)) == [
        "__0.metadata",
        "__0_0.distcp",
        "__1.metadata",
        "__1_0.distcp",
    ]
    return path


def _says_why(error: DistributedError, path: str) -> None:
    message = str(error)
    head = message.splitlines()[0]
    assert head.startswith("rank "), message
    assert f"nbtools.errors.CheckpointError: {path} is a rank-local checkpoint" in head, message
    assert "of 2 rank(s) (__0.metadata, __1.metadata), and this job has 3 ranks" in head
    assert "load it on 2 ranks, or save with use_collectives=True" in head
    assert "CheckpointException" not in head


def test_the_check_raises_the_reason_on_every_rank(two_rank_local):
    @distributed(processes=3)
    def check(path: str) -> None:
        check_rank_local(open_target(path), path)

    with pytest.raises(DistributedError) as failed:
        check.distributed(two_rank_local)
    _says_why(failed.value, two_rank_local)
    assert sorted(failed.value.failures) == [0, 1, 2]  # every rank alike: none left waiting


def test_dcp_load_at_another_world_size_leads_with_the_reason(two_rank_local):
    @distributed(processes=3)
    def load(path: str) -> None:
        import torch.distributed as dist

        rank = dist.get_rank()
        dcp.load({f"rank{rank}": torch.zeros(3)}, storage_reader=VolumeReader(path))

    with pytest.raises(DistributedError) as failed:
        load.distributed(two_rank_local)
    _says_why(failed.value, two_rank_local)
