"""Metadata and saved values are read without running code from the checkpoint."""

from __future__ import annotations

import logging
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools.checkpoint import CheckpointManager, VolumeReader, VolumeWriter, find_latest_valid
from nbtools.errors import CorruptCheckpointError, UnsafeCheckpointError

# torch before 2.13 drops the reader's error when dcp.load reads metadata (it falls back
# to rank-local metadata and fails an assertion instead); the load still fails.
_DCP_PASSES_READER_ERRORS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


class _RunsCommand:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(path, step: int = 1) -> None:
    dcp.save(
        {"model": {"w": torch.ones(3) * step}, "step": step}, storage_writer=VolumeWriter(path)
    )


def test_crafted_metadata_is_refused_skipped_and_nothing_runs(tmp_path, caplog):
    root = tmp_path / "root"
    saved = torch.nn.Linear(2, 2)
    with CheckpointManager(root, async_save=False) as ckpt:
        ckpt.save(1, model=saved)
    marker = tmp_path / "pwned"
    (root / "step_2").mkdir()
    (root / "step_2" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(str(marker))))
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert find_latest_valid(root) == str(root / "step_1")
    assert f"skipping checkpoint {root / 'step_2'} as unsafe" in caplog.text
    assert "posix.system" in caplog.text or "os.system" in caplog.text
    with pytest.raises(BaseException) as info:
        dcp.load({"model": {"w": torch.zeros(3)}}, storage_reader=VolumeReader(root / "step_2"))
    assert "refusing to unpickle" in str(info.value) or not _DCP_PASSES_READER_ERRORS
    # A restore falls back to the checkpoint before it, as past a damaged one.
    restored = torch.nn.Linear(2, 2)
    with CheckpointManager(root) as ckpt:
        assert ckpt.restore(model=restored) == 2
    assert torch.equal(restored.weight, saved.weight)
    assert not marker.exists()


def test_crafted_saved_value_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "c"
    dcp.save(
        {"model": {"w": torch.ones(3)}, "evil": _RunsCommand(str(marker))},
        storage_writer=VolumeWriter(path),
    )
    with pytest.raises(BaseException) as info:
        dcp.load({"model": {"w": torch.zeros(3)}, "evil": None}, storage_reader=VolumeReader(path))
    failures = getattr(info.value, "failures", {})
    assert any(isinstance(exc, UnsafeCheckpointError) for exc, _ in failures.values()), info.value
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing shard"])
def test_unreadable_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, damage):
    root = tmp_path / "root"
    _save(root / "step_1", 1)
    _save(root / "step_2", 2)
    meta = root / "step_2" / ".metadata"
    if damage == "truncated":
        meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    elif damage == "garbage":
        meta.write_bytes(b"\x00not a pickle at all")
    else:
        next((root / "step_2").glob("*.distcp")).unlink()
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert find_latest_valid(root) == str(root / "step_1")
    assert "skipping checkpoint" in caplog.text and "step_2" in caplog.text


def test_directories_without_metadata_are_ignored(tmp_path):
    root = tmp_path / "root"
    assert find_latest_valid(root) is None
    _save(root / "step_3", 3)
    (root / "step_9").mkdir()
    (root / "step_9" / "__0_0.distcp").write_bytes(b"partial")
    (root / "notes").mkdir()
    assert find_latest_valid(root) == str(root / "step_3")


def test_reader_error_names_the_problem(tmp_path):
    path = tmp_path / "c"
    _save(path)
    (path / ".metadata").write_bytes(b"junk")
    with pytest.raises(BaseException) as info:
        dcp.load({"model": {"w": torch.zeros(3)}}, storage_reader=VolumeReader(path))
    assert "cannot be read" in str(info.value) or not _DCP_PASSES_READER_ERRORS
    with pytest.raises(CorruptCheckpointError):
        VolumeReader(path).read_metadata()
