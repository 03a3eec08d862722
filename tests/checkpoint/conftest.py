"""Fixtures of the checkpoint tests: a private staging dir and a small tmpfs."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

# Constructing the first Adam sets TORCHINDUCTOR_CACHE_DIR and creates a cache dir in the
# temp dir (torch's one-time set-up); do it at collection so no test is blamed for it.
torch.optim.Adam([torch.zeros(1, requires_grad=True)])


@pytest.fixture(autouse=True)
def staging_dir(tmp_path, monkeypatch):
    """Every test stages under its own tmp_path, so staging leftovers are visible."""
    path = tmp_path / "staging"
    path.mkdir()
    monkeypatch.setenv("NBTOOLS_STAGING_DIR", str(path))
    return path


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 50 MB tmpfs mounted for the test (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
