"""A restore racing the retention of a run that saves into the same root."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from nbtools.checkpoint import CheckpointManager


class _RacingStore(MemoryFileSystem):
    """An object store where another run acts right after a listing of the root: it
    publishes a newer checkpoint and its retention (``keep=1``) deletes the listed one."""

    protocol = "nbtrace"
    root = ""
    hidden = ""
    raced = False

    def ls(self, path, detail=True, **kwargs):
        listed = super().ls(path, detail=detail, **kwargs)
        if self._strip_protocol(path).rstrip("/") == _RacingStore.root and not _RacingStore.raced:
            _RacingStore.raced = True
            self.mv(f"{_RacingStore.hidden}/step_2", f"{_RacingStore.root}/step_2", recursive=True)
            self.rm(f"{_RacingStore.root}/step_1", recursive=True)
        return listed


fsspec.register_implementation("nbtrace", _RacingStore, clobber=True)


@pytest.fixture
def bucket():
    name = f"nbtools-test-{uuid.uuid4().hex}"
    yield name
    fs = _RacingStore()
    for key in [k for k in fs.store if f"//{name}/" in k]:
        del fs.store[key]
    for key in [k for k in fs.pseudo_dirs if f"//{name}" in k]:
        fs.pseudo_dirs.remove(key)


def _save(root: str, step: int) -> None:
    net = torch.nn.Linear(4, 4)
    with torch.no_grad():
        net.weight.fill_(float(step))
    with CheckpointManager(root, async_save=False, save_on_close=False) as ckpt:
        ckpt.save(step, model=net)


def test_a_checkpoint_deleted_between_the_listing_and_its_check_sends_the_restore_to_the_newer_one(
    bucket,
):
    fs = _RacingStore()
    _save(f"nbtrace://{bucket}/other", 2)  # what the other run publishes during the listing
    _save(f"nbtrace://{bucket}/ckpt", 1)
    where = _RacingStore._strip_protocol
    _RacingStore.root = where(f"nbtrace://{bucket}/ckpt")
    _RacingStore.hidden = where(f"nbtrace://{bucket}/other")
    _RacingStore.raced = False
    net = torch.nn.Linear(4, 4)
    with CheckpointManager(f"nbtrace://{bucket}/ckpt", async_save=False) as ckpt:
        assert ckpt.restore(model=net) == 3  # not 0: "no checkpoint" would start afresh
    assert _RacingStore.raced
    assert torch.equal(net.weight, torch.full((4, 4), 2.0))
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(_RacingStore.root, detail=False)]
    assert "step_1" not in names and "step_2" in names
