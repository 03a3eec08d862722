"""Fixtures of the data tests: small file trees and a small tmpfs."""

from __future__ import annotations

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
