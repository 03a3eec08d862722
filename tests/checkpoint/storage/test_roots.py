"""Roots other users can write, and checkpoints they planted, acted out by a real second user.

The second user is created for the module with ``useradd`` and removed after it;
everything it does goes through ``runuser``. Needs root.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import tempfile
import uuid

import pytest
import torch

from nbtools.checkpoint import CheckpointManager, find_latest_valid
from nbtools.errors import CheckpointError


@pytest.fixture(scope="module")
def intruder():
    """The name of a local user created for these tests (removed afterwards)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "userdel", "runuser")):
        pytest.skip("acting as a second user needs root, useradd, userdel and runuser")
    name = f"nbt{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)


@pytest.fixture
def shared(intruder):
    """A sticky, world-writable directory (like /tmp) that the second user can reach."""
    base = tempfile.mkdtemp(prefix="nbtools-ckpt-shared-", dir="/tmp")
    try:
        os.chmod(base, 0o1777)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as(user: str, *argv: str) -> None:
    done = subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _model(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


def test_a_root_another_user_opened_to_everyone_is_refused(shared, intruder):
    root = os.path.join(shared, "ckpt")
    _as(intruder, "mkdir", "-m", "0777", root)
    with pytest.raises(CheckpointError) as refused:
        CheckpointManager(root)
    message = str(refused.value)
    assert f"refusing the checkpoint root {root}: other users can write to it" in message
    assert f"mode 0777, owned by '{intruder}'" in message
    assert "Use a directory of your own" in message
    assert os.listdir(root) == []  # nothing written there, not even the lease
    mine = os.path.join(shared, "mine")  # the user's own root, opened to all: the same
    os.mkdir(mine)
    os.chmod(mine, 0o777)
    with pytest.raises(CheckpointError, match=f"chmod o-w {mine}"):
        CheckpointManager(mine)


def test_checkpoints_another_user_planted_are_neither_restored_nor_counted(
    shared, intruder, caplog
):
    theirs, root = os.path.join(shared, "theirs"), os.path.join(shared, "root")
    with CheckpointManager(theirs, async_save=False) as ckpt:
        ckpt.save(5, model=_model(666.0))  # what the other user wants the victim to load
    subprocess.run(["chmod", "-R", "a+rX", theirs], check=True)  # theirs to copy
    with CheckpointManager(root, async_save=False) as ckpt:
        ckpt.save(1, model=_model(1.0))
    # The root was open for a while (then closed, as the refusal says): they planted two
    # checkpoints newer than the user's, one a copy of theirs, one with a crafted .metadata.
    os.chmod(root, 0o777)
    _as(intruder, "cp", "-r", os.path.join(theirs, "step_5"), os.path.join(root, "step_9"))
    _as(intruder, "mkdir", os.path.join(root, "step_12"))
    crafted = os.path.join(shared, "crafted")
    with open(crafted, "wb") as fh:
        fh.write(pickle.dumps(Exception("a type DCP metadata never holds")))
    _as(intruder, "cp", crafted, os.path.join(root, "step_12", ".metadata"))
    os.chmod(root, 0o755)

    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert find_latest_valid(root) == os.path.join(root, "step_1")
    for planted in ("step_9", "step_12"):
        assert f"skipping checkpoint {os.path.join(root, planted)} as unsafe" in caplog.text
    assert f"owned by '{intruder}'" in caplog.text

    restored = _model(0.0)
    with CheckpointManager(root, every=1, keep=1, async_save=False) as ckpt:
        assert ckpt.restore(model=restored) == 2
        assert torch.all(restored.weight == 1.0)
        # Retention counts the user's checkpoints only: the newest kept is the user's step_2.
        ckpt.save(2, model=restored)
    assert sorted(os.listdir(root)) == ["step_12", "step_2", "step_9"]
