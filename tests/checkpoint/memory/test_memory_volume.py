"""A restart that restores from memory asks the volume nothing it already knows.

The ranks record what they know of the volume beside their snapshots (the newest
step when they last looked, and every save they started since). The volume here
is an object store (fsspec's in-memory one, registered under a protocol of its
own so that the test counts the listings of the checkpoint root).
"""

from __future__ import annotations

import time
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from nbtools.checkpoint import CheckpointManager
from nbtools.checkpoint import manager as manager_module


class _CountingStore(MemoryFileSystem):
    """An object store that counts how often each directory is listed and each file read."""

    protocol = "nbtcount"
    listings: dict[str, int] = {}
    reads: dict[str, int] = {}

    def cat_file(self, path, start=None, end=None, **kwargs):
        key = self._strip_protocol(path)
        _CountingStore.reads[key] = _CountingStore.reads.get(key, 0) + 1
        return super().cat_file(path, start=start, end=end, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        key = self._strip_protocol(path).rstrip("/")
        _CountingStore.listings[key] = _CountingStore.listings.get(key, 0) + 1
        return super().ls(path, detail=detail, **kwargs)


fsspec.register_implementation("nbtcount", _CountingStore, clobber=True)


@pytest.fixture
def root():
    name = f"nbtools-test-{uuid.uuid4().hex}"
    yield f"nbtcount://{name}/ckpt"
    fs = _CountingStore()
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)
    _CountingStore.listings.clear()
    _CountingStore.reads.clear()


def _listed(root: str) -> int:
    return _CountingStore.listings.get(_CountingStore._strip_protocol(root).rstrip("/"), 0)


def _net():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def _killed_run(root: str, every: int, steps: int, memory_every: int = 3) -> dict:
    """Restore, train ``steps`` steps, die with an error (snapshots kept); the weights."""
    net, opt = _net()
    with (
        pytest.raises(RuntimeError, match="killed"),
        CheckpointManager(root, every=every, memory_every=memory_every, async_save=False) as ckpt,
    ):
        ckpt.restore(model=net, optimizer=opt)
        for step in range(steps):
            opt.zero_grad()
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
            ckpt.maybe_save(step, model=net, optimizer=opt)
        weights = {k: v.clone() for k, v in net.state_dict().items()}
        raise RuntimeError("killed")
    return weights


def test_a_restart_from_memory_does_not_list_the_volume(root, shm):
    weights = _killed_run(root, every=10, steps=13)  # volume: 0, 10; memory: 12
    before = _listed(root)
    net, opt = _net()
    with CheckpointManager(root, memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 13
        assert again.restored_tier == "memory"
        assert _listed(root) == before  # what the volume holds was known: no listing
        assert again.last_saved_step == 10
    for name, value in net.state_dict().items():
        assert torch.equal(value, weights[name])
    assert not [p for p in shm.rglob("*") if p.is_file()]  # a clean close: nothing left


def _lease_reads(root: str) -> int:
    lease = _CountingStore._strip_protocol(root).rstrip("/") + "/.nbtools-writer"
    return _CountingStore.reads.get(lease, 0)


@pytest.mark.parametrize("wait", [3600.0, 0.0])
def test_a_recovery_from_memory_reads_the_writer_lease_only_after_its_first_steps(
    root, shm, monkeypatch, wait
):
    # The lease is read ahead of the next volume save, in the background; in a fresh
    # process that starts the store's client, a second of CPU a recovery does not wait for.
    monkeypatch.setattr(manager_module, "AFTER_RECOVERY_S", wait)
    _killed_run(root, every=10, steps=13)
    before = _lease_reads(root)
    net, opt = _net()
    with CheckpointManager(root, every=10, memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 13
        assert again.restored_tier == "memory"
        assert _lease_reads(root) == before
        for step in (13, 14):  # the first steps' saves: the probe starts from here once due
            again.maybe_save(step, model=net, optimizer=opt)
        deadline = time.monotonic() + (60 if wait == 0 else 1)
        while _lease_reads(root) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (_lease_reads(root) > before) == (wait == 0)
        assert again.maybe_save(20, model=net, optimizer=opt)  # the volume save goes ahead
        assert _lease_reads(root) > before


def test_a_volume_save_due_early_in_a_recovery_reads_the_lease_itself(root, shm):
    _killed_run(root, every=10, steps=18)  # memory: 15 (every 3); volume: 10
    net, opt = _net()
    with CheckpointManager(root, every=10, memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 16
        assert again.restored_tier == "memory"
        before = _lease_reads(root)
        for step in range(16, 20):
            assert not again.maybe_save(step, model=net, optimizer=opt)
        assert again.maybe_save(20, model=net, optimizer=opt)  # well before the probe's time
        assert _lease_reads(root) > before
    assert sorted(_CountingStore().ls(_CountingStore._strip_protocol(root), detail=False))[
        -1
    ].endswith("step_20")


def test_a_save_started_after_the_last_snapshot_is_looked_for_and_wins(root, shm):
    _killed_run(root, every=7, steps=15)  # memory: 12; a volume save of 14 started after it
    before = _listed(root)
    net, opt = _net()
    with CheckpointManager(root, memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 15
        assert again.restored_tier == "volume"
        assert _listed(root) > before


@pytest.mark.parametrize("damage", ["removed", "writable by others"])
def test_without_records_to_trust_the_volume_is_listed(root, shm, damage):
    _killed_run(root, every=10, steps=13)
    records = list(shm.rglob("volume-r*.json"))
    assert records  # each rank keeps one beside its snapshots
    for record in records:
        record.unlink() if damage == "removed" else record.chmod(0o666)
    before = _listed(root)
    net, opt = _net()
    with CheckpointManager(root, memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 13
        assert again.restored_tier == "memory"
        assert _listed(root) > before


def test_a_clean_close_leaves_no_record(root, shm):
    net, opt = _net()
    with CheckpointManager(root, every=10, memory_every=3, async_save=False) as ckpt:
        ckpt.restore(model=net, optimizer=opt)
        assert list(shm.rglob("volume-r*.json"))
        ckpt.maybe_save(0, model=net, optimizer=opt)
    assert not [p for p in shm.rglob("*") if p.is_file()]
