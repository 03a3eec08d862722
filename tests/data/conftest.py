"""Fixtures of the data tests: small file trees, a small tmpfs, and room in memory for a large
tree."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _data_helpers import make_tree


@pytest.fixture
def tree(tmp_path):
    """A source tree of 40 small files and an empty cache directory."""
    src = tmp_path / "src"
    make_tree(src, 40)
    return src, tmp_path / "cache"


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    """A 30MB tmpfs mounted for the test (root only), unmounted afterwards."""
    return mount_tmpfs("30m")


@pytest.fixture
def memory_volume(tmp_path) -> Iterator[Path]:
    """An empty directory on the machine's memory filesystem (``/dev/shm``), removed after the
    test, for trees of a million entries: creating and removing them there takes a few seconds,
    where a journalling disk shared with the other tests takes a minute. ``tmp_path`` where
    there is no ``/dev/shm``."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path / "volume"
        return
    path = tempfile.mkdtemp(prefix="nbtools-tests-volume-", dir="/dev/shm")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
