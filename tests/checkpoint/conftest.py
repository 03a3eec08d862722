"""Fixtures of the checkpoint tests: a private staging dir and small models."""

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


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def make_training(seed: int = 0):
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    import random

    import numpy as np

    x = torch.randn(8, 4) + random.random() + float(np.random.rand())
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


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
