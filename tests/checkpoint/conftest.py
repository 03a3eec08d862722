"""Fixtures of the checkpoint tests: a private staging dir, a snapshot base, a small tmpfs."""

from __future__ import annotations

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
def shm(tmp_path, monkeypatch):
    """A snapshot base of the test's own for the memory tier (``NBTOOLS_SNAPSHOT_DIR``)."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(path))
    return path


@pytest.fixture
def tiny_tmpfs(mount_tmpfs):
    """A 50MB tmpfs mounted for the test (root only), unmounted afterwards."""
    return mount_tmpfs("50m")
