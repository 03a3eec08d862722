"""Where the pool puts its socket: a long temporary directory does not stop it."""

from __future__ import annotations

import os
import stat
import tempfile

from nbtools.launch import RankPool


def test_a_long_tmpdir_still_starts_a_pool_with_a_private_socket(monkeypatch):
    base = tempfile.gettempdir()
    long_dir = os.path.join(base, "t" * max(1, 68 - len(base) - 1))
    assert len(long_dir) >= 68
    os.mkdir(long_dir, 0o700)
    try:
        monkeypatch.setenv("TMPDIR", long_dir)
        monkeypatch.setattr(tempfile, "tempdir", None)
        with RankPool(processes=1, output="none") as pool:
            listener = pool._gens.ranks.listener
            socket_dir = os.path.dirname(listener.address)
            assert pool.execute("40 + 2") == [42]
            assert pool._run_dir.startswith(long_dir)
        assert len(os.fsencode(listener.address)) <= 100 and not socket_dir.startswith(long_dir)
        assert not os.path.exists(socket_dir)  # removed once every rank was in
    finally:
        monkeypatch.setattr(tempfile, "tempdir", None)
        monkeypatch.undo()
        os.rmdir(long_dir)


def test_the_short_socket_directory_is_private(monkeypatch):
    from nbtools.launch.pool._channel import socket_directory

    directory = socket_directory()
    try:
        info = os.stat(directory)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        assert len(directory) < 70
    finally:
        os.rmdir(directory)
