"""VolumeWriter / VolumeReader: round trips, interop with PyTorch's filesystem backends, faults."""

from __future__ import annotations

import os
import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.errors import CorruptCheckpointError, StagingSpaceError


def _state() -> dict:
    torch.manual_seed(1)
    return {
        "model": {"w": torch.randn(64, 32), "b": torch.randn(32), "half": torch.randn(7).half()},
        "step": 12,
        "misc": {"note": "hi", "ids": [1, 2, 3]},
    }


def _empty() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32), "half": torch.zeros(7).half()},
        "step": 0,
        "misc": {"note": "", "ids": []},
    }


def _assert_same(a: dict, b: dict) -> None:
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["step"] == b["step"] and a["misc"] == b["misc"]


@pytest.mark.parametrize("stage", [False, True])
def test_round_trip(tmp_path, staging_dir, stage):
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=VolumeWriter(path, thread_count=3))
    assert (path / ".metadata").is_file()
    assert sorted(p.name for p in path.glob("*.distcp")) == [
        "__0_0.distcp",
        "__0_1.distcp",
        "__0_2.distcp",
    ]
    out = _empty()
    dcp.load(out, storage_reader=VolumeReader(path, stage=stage))
    _assert_same(_state(), out)
    assert os.listdir(staging_dir) == []  # staged files removed after upload and after download


def test_pytorch_reader_loads_volume_writer_output(tmp_path):
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "c"))
    out = _empty()
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path / "c"))
    _assert_same(_state(), out)


def test_volume_reader_loads_pytorch_writer_output(tmp_path):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(tmp_path / "c"))
    out = _empty()
    dcp.load(out, storage_reader=VolumeReader(tmp_path / "c"))
    _assert_same(_state(), out)


def test_fsspec_url_target(staging_dir):
    import fsspec

    url = f"memory://nbtools-test-{uuid.uuid4().hex}/step_1"
    try:
        dcp.save(_state(), storage_writer=VolumeWriter(url))
        fs = fsspec.filesystem("memory")
        assert fs.exists(url + "/.metadata")
        out = _empty()
        dcp.load(out, storage_reader=VolumeReader(url))  # remote: downloaded to staging first
        _assert_same(_state(), out)
        assert os.listdir(staging_dir) == []
    finally:
        fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


def test_checksums_are_recorded_and_damage_is_detected(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=VolumeWriter(path, thread_count=1))
    md = pickle.loads((path / ".metadata").read_bytes())
    assert all(
        getattr(info, "checksum", "").startswith("crc32:") for info in md.storage_data.values()
    )
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of a tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(BaseException) as info:
        dcp.load(_empty(), storage_reader=VolumeReader(path))
    failures = getattr(info.value, "failures", {0: (info.value, None)})
    assert any(isinstance(exc, CorruptCheckpointError) for exc, _ in failures.values()), info.value


def test_loads_into_destinations_of_any_layout(tmp_path):
    # Contiguous destinations, such as a slice of a larger tensor, are read into directly
    # (and only their own bytes change); a transposed view takes the general path.
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "c"))
    backing = torch.zeros(40)
    out = _empty()
    out["model"]["w"] = torch.zeros(32, 64).t()
    out["model"]["b"] = backing[4:36]
    dcp.load(out, storage_reader=VolumeReader(tmp_path / "c"))
    _assert_same(_state(), out)
    assert torch.equal(backing[4:36], _state()["model"]["b"])
    assert not backing[:4].any() and not backing[36:].any()


def test_truncated_shard_is_detected(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=VolumeWriter(path, thread_count=1))
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(BaseException) as info:
        dcp.load(_empty(), storage_reader=VolumeReader(path))
    failures = getattr(info.value, "failures", {0: (info.value, None)})
    assert any(isinstance(exc, CorruptCheckpointError) for exc, _ in failures.values()), info.value


def test_saving_into_a_complete_checkpoint_replaces_it(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=VolumeWriter(path))
    before = {p.name for p in path.iterdir()}
    changed = _state()
    changed["step"] = 99
    dcp.save(changed, storage_writer=VolumeWriter(path))
    got = _empty()
    dcp.load(got, storage_reader=VolumeReader(path))
    assert got["step"] == 99
    # The new shards were written next to the old ones, which are gone now.
    after = {p.name for p in path.iterdir()}
    assert ".metadata" in after and not (after - {".metadata"}) & before


def test_stale_files_of_an_interrupted_save_are_replaced(tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    (path / "__7_0.distcp").write_bytes(b"left by a dead rank")
    (path / "__0_0.distcp").write_bytes(b"half written")
    dcp.save(_state(), storage_writer=VolumeWriter(path, thread_count=1))
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp"]
    out = _empty()
    dcp.load(out, storage_reader=VolumeReader(path))
    _assert_same(_state(), out)


def test_staging_removed_after_a_failed_save(tmp_path, staging_dir):
    bad = _state()
    bad["misc"]["fn"] = lambda: None  # cannot be pickled: fails while writing shards
    with pytest.raises(BaseException, match="pickle"):
        dcp.save(bad, storage_writer=VolumeWriter(tmp_path / "c"))
    assert os.listdir(staging_dir) == []
    assert not (tmp_path / "c" / ".metadata").exists()


def test_path_that_is_a_file_is_rejected(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        VolumeWriter(tmp_path / "f")


@pytest.mark.root
def test_small_staging_filesystem_is_a_clear_error(tmp_path, tiny_tmpfs, monkeypatch):
    from nbtools.checkpoint import CheckpointManager, find_latest_valid

    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False, staging_dir=tiny_tmpfs) as ckpt:
        small = torch.nn.Linear(10, 10)
        ckpt.save(1, model=small)
        big = torch.nn.Linear(4000, 4000)  # 64 MB of weights, more than the 50 MB tmpfs
        with pytest.raises(StagingSpaceError, match="staging space"):
            ckpt.save(2, model=big)
    assert os.listdir(tiny_tmpfs) == []
    assert find_latest_valid(root) == str(root / "step_1")
    restored = torch.nn.Linear(10, 10)
    assert CheckpointManager(root).restore(model=restored) == 2
    assert torch.equal(restored.weight, small.weight)
