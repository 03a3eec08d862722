"""Faults and hostile input in a checkpoint root: links, damaged data, a full staging disk."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from ckpt_training import Net

from nbtools import events
from nbtools.checkpoint import CheckpointManager, find_latest_valid
from nbtools.checkpoint._retention import purge
from nbtools.checkpoint._storage._target import LocalTarget
from nbtools.errors import CheckpointError, CorruptCheckpointError, StagingSpaceError


def _saved(root, *steps, seed=0):
    """Checkpoints of a model at ``steps`` (weights differ per step); the models by step."""
    models = {}
    with CheckpointManager(root, async_save=False) as ckpt:
        for step in steps:
            torch.manual_seed(seed + step)
            models[step] = torch.nn.Linear(64, 64)
            ckpt.save(step, model=models[step])
    return models


def _flip_a_byte(step_dir) -> None:
    """Flip one byte in the middle of the largest shard; its size stays the same."""
    shard = max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


# --- symbolic links ----------------------------------------------------------


def test_a_linked_step_directory_is_neither_used_nor_deleted_through(tmp_path, caplog):
    other, root = tmp_path / "other", tmp_path / "root"
    _saved(other, 5)
    _saved(root, 1)
    (root / "step_9").symlink_to(other / "step_5")
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert find_latest_valid(root) == str(root / "step_1")
    assert "symbolic link" in caplog.text and "step_9" in caplog.text
    restored = torch.nn.Linear(64, 64)
    assert CheckpointManager(root).restore(model=restored) == 2  # step 1, not the link's 5

    with CheckpointManager(root, keep=1) as ckpt:
        ckpt.save(2, model=torch.nn.Linear(64, 64))
    assert sorted(os.listdir(root)) == ["step_2", "step_9"]  # step 1 went; the link is left
    assert (other / "step_5" / ".metadata").exists()  # nothing outside the root was deleted
    assert find_latest_valid(other) == str(other / "step_5")


def test_no_save_is_written_through_a_link(tmp_path):
    elsewhere, root = tmp_path / "elsewhere", tmp_path / "root"
    elsewhere.mkdir()
    root.mkdir()
    (root / "step_3").symlink_to(elsewhere)
    with CheckpointManager(root) as ckpt, pytest.raises(CheckpointError, match="symbolic link"):
        ckpt.save(3, model=Net())
    assert os.listdir(elsewhere) == []


def test_a_shard_that_is_a_link_is_not_read(tmp_path, caplog):
    root = tmp_path / "root"
    _saved(root, 1, 2)
    shard = next((root / "step_2").glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    shard.rename(outside)
    shard.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert find_latest_valid(root) == str(root / "step_1")
    assert "symbolic link" in caplog.text


# --- damaged data --------------------------------------------------------------


def test_flipped_bytes_are_found_by_verify_and_restore_falls_back(tmp_path, caplog):
    root = tmp_path / "root"
    models = _saved(root, 1, 2)
    _flip_a_byte(root / "step_2")
    assert find_latest_valid(root) == str(root / "step_2")  # sizes only: looks complete
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert find_latest_valid(root, verify=True) == str(root / "step_1")
    assert "skipping checkpoint" in caplog.text and "checksum" in caplog.text
    caplog.clear()

    restored = torch.nn.Linear(64, 64)
    ckpt = CheckpointManager(root)
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert ckpt.restore(model=restored) == 2
    assert ckpt.restored_step == 1
    assert torch.equal(restored.weight, models[1].weight)
    assert [url for url, _ in ckpt.skipped] == [str(root / "step_2")]
    assert "checksum" in ckpt.skipped[0][1]
    assert re.search(r"skipping checkpoint \S*step_2: .*checksum", caplog.text)
    skipped = [e for e in events.log(kinds=["checkpoint_skipped"]) if str(root) in e.message]
    assert [e.step for e in skipped] == [2] and "checksum" in skipped[0].message
    ckpt.close()


def test_restore_when_no_checkpoint_verifies_is_an_error(tmp_path):
    root = tmp_path / "root"
    _saved(root, 1)
    _flip_a_byte(root / "step_1")
    with pytest.raises(CorruptCheckpointError, match="no checkpoint under .* verifies"):
        CheckpointManager(root).restore(model=torch.nn.Linear(64, 64))


def test_verify_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="verify must be a bool"):
        find_latest_valid(tmp_path, verify="yes")


# --- staging space -----------------------------------------------------------------


@pytest.mark.root
@pytest.mark.parametrize("async_save", [True, False])
def test_a_refused_save_states_the_reserve_and_leaves_no_step_directory(
    tmp_path, mount_tmpfs, async_save
):
    staging = mount_tmpfs("24m")
    root = tmp_path / "root"
    big = torch.nn.Linear(1500, 1500)  # about 8.6 MiB: fits the free space, not with the reserve
    with CheckpointManager(root, async_save=async_save, staging_dir=staging) as ckpt:
        ckpt.save(1, model=torch.nn.Linear(2, 2))
        with pytest.raises(StagingSpaceError) as info:
            ckpt.save(2, model=big)
            ckpt.wait()
    message = str(info.value)
    needs, reserve, free = (
        float(x)
        for x in re.search(
            r"needs about ([\d.]+) MiB .* reserve of ([\d.]+) MiB.* has ([\d.]+) MiB free", message
        ).groups()
    )
    assert needs < free < needs + reserve, message  # the figures agree with the refusal
    assert sorted(os.listdir(root)) == ["step_1"]  # no empty step_2/
    assert os.listdir(staging) == []


@pytest.mark.root
def test_a_staging_disk_that_fills_during_an_async_save_is_named_with_its_free_space(
    tmp_path, mount_tmpfs
):
    staging = mount_tmpfs("24m")
    root = tmp_path / "root"
    # The space check passes (the extra's size is not known before it is written), and
    # the shard write then runs into the end of the 24 MiB filesystem.
    with CheckpointManager(root, async_save=True, staging_dir=staging) as ckpt:
        ckpt.save(1, model=torch.nn.Linear(2, 2))
        ckpt.wait()
        with pytest.raises(StagingSpaceError) as info:
            ckpt.save(2, model=torch.nn.Linear(2, 2), extra={"blob": os.urandom(40 << 20)})
            ckpt.wait()
    message = str(info.value)
    assert message.startswith(f"staging directory {staging} is full: "), message
    free, needed = (
        float(x)
        for x in re.search(r"([\d.]+) MiB free, about ([\d.]+) MiB needed", message).groups()
    )
    assert free < 1 < needed, message
    assert "NBTOOLS_STAGING_DIR" in message and "rank 0" in message
    assert "inline_container" not in message.split(". Free")[0].split("(")[0]
    assert isinstance(info.value, OSError)
    assert sorted(os.listdir(root)) == ["step_1"]  # the failed step is never published
    assert os.listdir(staging) == []  # and its partial shards are gone
    # Once the space is back, the next save works.
    with CheckpointManager(root, async_save=True, staging_dir=staging) as ckpt:
        ckpt.save(3, model=torch.nn.Linear(2, 2))
    assert sorted(os.listdir(root)) == ["step_1", "step_3"]


@pytest.mark.root
def test_torchs_own_write_error_on_a_full_staging_disk_reads_as_a_space_error(mount_tmpfs):
    from nbtools.checkpoint._storage import _scratch

    staging = mount_tmpfs("4m")
    with pytest.raises(OSError), open(staging / "filler", "wb") as fh:
        fh.write(b"x" * (8 << 20))
    torch_error = RuntimeError(
        "[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598"
    )
    err = _scratch.space_error(torch_error, str(staging), 6 << 20, "rank 0 saving /vol/step_2")
    assert isinstance(err, StagingSpaceError)
    assert str(err).startswith(f"staging directory {staging} is full: 0.0 MiB free, about 6.0 MiB")
    os.unlink(staging / "filler")  # the space is back: the same error is not a space problem
    assert _scratch.space_error(torch_error, str(staging), 1 << 20, "saving") is None


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from nbtools.checkpoint._storage import _scratch
    with _scratch.staging_area(sys.argv[1]) as stage:
        with open(os.path.join(stage, "__0_0.distcp"), "wb") as fh:
            fh.write(os.urandom(1 << 20))
        print(stage, flush=True)
        time.sleep(600)
    """
)


def _killed_writer(staging) -> str:
    """A process that stages a shard the way a save does and is SIGKILLed mid-save."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(staging)], stdout=subprocess.PIPE, text=True
    )
    try:
        stage = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert stage and os.path.isdir(stage)
    return stage


def test_a_killed_writers_staging_is_swept_when_a_manager_starts(tmp_path):
    staging = tmp_path / "staging"
    stage = _killed_writer(staging)
    with CheckpointManager(tmp_path / "root", staging_dir=staging):
        assert not os.path.exists(stage)


@pytest.mark.slow
def test_a_killed_writers_staging_is_swept_by_a_restore(tmp_path):
    staging = tmp_path / "staging"
    root = tmp_path / "root"
    _saved(root, 1)
    with CheckpointManager(root, staging_dir=staging) as ckpt:
        stage = _killed_writer(staging)  # killed while this run trains, before it saves
        assert ckpt.restore(model=torch.nn.Linear(64, 64)) == 2
        assert not os.path.exists(stage)


def test_staging_named_by_a_reused_process_id_is_swept(tmp_path):
    from nbtools.checkpoint._storage import _scratch

    newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        old = tmp_path / f"nbtools-stage-{newer.pid}-x1"  # a killed writer's, an hour ago
        old.mkdir()
        os.utime(old, (os.path.getmtime(old) - 3600,) * 2)
        assert _scratch.sweep(str(tmp_path)) == [old.name]
    finally:
        newer.kill()
        newer.wait()


def test_a_live_writers_staging_is_kept(tmp_path):
    from nbtools.checkpoint._storage import _scratch

    with _scratch.staging_area(str(tmp_path)) as stage:
        with CheckpointManager(tmp_path / "root", staging_dir=tmp_path):
            assert os.path.isdir(stage)


# --- retention -------------------------------------------------------------------


def test_retention_never_deletes_a_step_being_saved(tmp_path):
    root = tmp_path / "root"
    _saved(root, 10)
    (root / "step_5").mkdir()  # older than the newest, but being written now
    (root / "step_4").mkdir()  # an old partial nobody writes
    assert purge(LocalTarget(root), keep=1, protect=[5]) == [4]
    assert sorted(os.listdir(root)) == ["step_10", "step_5"]
