"""The shared staging directory of a node's ranks is used only when it is this user's alone:
its records are read back into the checkpoint's tensors, so a directory another user planted
(or one others may write into) is refused before anything is read from it."""

from __future__ import annotations

import os

import pytest

from nbtools.checkpoint._storage import _scratch
from nbtools.errors import CheckpointError


def test_a_fresh_shared_area_is_private_and_removed_by_the_last_to_leave(tmp_path):
    with _scratch.shared_area(str(tmp_path), "area-1") as path:
        assert os.stat(path).st_mode & 0o777 == 0o700
    assert not os.path.exists(path)


def test_a_shared_area_others_may_write_into_is_refused(tmp_path):
    planted = tmp_path / "area-2"
    planted.mkdir()
    planted.chmod(0o777)
    (planted / "record").write_bytes(b"not ours")
    with (
        pytest.raises(CheckpointError, match=r"area-2 is not a directory of this user's alone"),
        _scratch.shared_area(str(tmp_path), "area-2"),
    ):
        pass
    assert (planted / "record").read_bytes() == b"not ours"  # left as found


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user owns")
def test_a_shared_area_another_user_owns_is_refused(tmp_path):
    planted = tmp_path / "area-3"
    planted.mkdir(mode=0o700)
    os.chown(planted, 1001, 1001)
    with (
        pytest.raises(CheckpointError, match="owner uid 1001"),
        _scratch.shared_area(str(tmp_path), "area-3"),
    ):
        pass
