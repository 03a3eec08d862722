"""Fixtures of the data tests: small file trees and a small tmpfs."""

from __future__ import annotations

import os
import subprocess

import pytest
from _data_helpers import make_tree


@pytest.fixture
def tree(tmp_path):
    """A source tree of 40 small files and an empty cache directory."""
    src = tmp_path / "src"
    make_tree(src, 40)
    return src, tmp_path / "cache"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 30 MB tmpfs mounted for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
