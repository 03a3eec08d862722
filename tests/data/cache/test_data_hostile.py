"""Hostile input and other users: a private cache, symlink loops, odd names, plain errors."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile

import pytest
from _data_helpers import content, index_of, make_tree

from nbtools.data import VolumeDataset
from nbtools.data._cache._file_cache import TMP_PREFIX, FileCache
from nbtools.data._cache._location import default_cache_dir
from nbtools.errors import CacheError


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True, text=True)


@pytest.fixture
def shared_tmp():
    """A sticky, world-writable directory (like /tmp) that the user ``nobody`` can reach."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("acting as a second user needs root and runuser")
    base = tempfile.mkdtemp(prefix="nbtools-shared-", dir="/tmp")
    try:
        os.chmod(base, 0o1777)
        if _as_nobody("true").returncode != 0:
            pytest.skip("runuser -u nobody does not work here")
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_default_cache_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("NBTOOLS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    where = default_cache_dir()
    assert where == str(tmp_path / "xdg" / "nbtools")
    assert not where.startswith(tempfile.gettempdir() + os.sep + "nbtools-cache")
    make_tree(tmp_path / "src", 3)
    files = VolumeDataset(tmp_path / "src")
    assert files.cache_dir == where
    paths = list(files)
    assert all(p.startswith(where + os.sep) for p in paths)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700


def test_a_cache_directory_planted_by_another_user_is_refused(tmp_path, shared_tmp, monkeypatch):
    planted = os.path.join(shared_tmp, f"nbtools-cache-{os.getuid()}")
    # What the attacker does before the victim's first run: a 0777 directory
    # holding a file under the name the victim's data will be cached as.
    assert _as_nobody("mkdir", "-m", "0777", planted).returncode == 0
    make_tree(tmp_path / "src", 3)
    files = VolumeDataset(tmp_path / "src", cache_dir=planted)
    with pytest.raises(CacheError, match=r"owned by 'nobody'.*Remove it, or pass cache_dir="):
        list(files)
    # The fallback location under a shared temporary directory gets the same check.
    monkeypatch.setenv("NBTOOLS_CACHE_DIR", os.path.join(str(tmp_path / "file"), "below"))
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError):
        default_cache_dir()  # an explicit NBTOOLS_CACHE_DIR that cannot be created is an error
    monkeypatch.delenv("NBTOOLS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # cannot hold a directory
    monkeypatch.setenv("TMPDIR", shared_tmp)
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert default_cache_dir() == planted
    with pytest.raises(CacheError, match="owned by 'nobody'"):
        list(VolumeDataset(tmp_path / "src"))


def test_a_cache_directory_others_can_write_is_refused_and_copies_are_private(tmp_path, shared_tmp):
    mine = os.path.join(shared_tmp, "mine")
    os.mkdir(mine)
    os.chmod(mine, 0o777)
    make_tree(tmp_path / "src", 3)
    with pytest.raises(CacheError, match=r"other users can write to it \(mode 0777\)"):
        list(VolumeDataset(tmp_path / "src", cache_dir=mine))
    os.chmod(mine, 0o755)  # readable by others: tightened, not refused
    paths = list(VolumeDataset(tmp_path / "src", cache_dir=mine))
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    assert _as_nobody("cat", paths[0]).returncode != 0
    assert _as_nobody("ls", mine).returncode != 0


def test_cache_error_prints_a_plain_message(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheError) as info:
        FileCache(str(tmp_path / "file" / "cache"))
    text = str(info.value)
    assert text.startswith("cannot create the cache directory"), text
    assert "pass cache_dir=" in text
    assert info.value.errno is not None and isinstance(info.value, OSError)


def test_opening_a_cache_sweeps_temporaries_of_killed_copies(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = tmp_path / "c" / "ns"
    ns.mkdir(parents=True)
    stale = ns / f"{TMP_PREFIX}{dead.pid}-abcdef"
    stale.write_bytes(b"half a file")
    alive = ns / f"{TMP_PREFIX}{os.getpid()}-abcdef"
    alive.write_bytes(b"a copy in progress")
    FileCache(str(tmp_path / "c"), min_free_bytes=0)
    assert not stale.exists()
    assert alive.exists()  # its process still runs
    alive.unlink()


def test_a_symlink_loop_lists_each_file_once(tmp_path):
    src = tmp_path / "src"
    make_tree(src, 3, dirs=1)
    (src / "d0" / "up").symlink_to("..")  # d0/up/d0/up/... forever
    (src / "alias").symlink_to("d0")  # the same directory under a second name
    files = VolumeDataset(src, cache_dir=tmp_path / "c")
    assert len(files) == 3
    got = {index_of(p): open(p, "rb").read() for p in files}
    assert got == {i: content(i, 64) for i in range(3)}


def test_a_file_name_that_is_not_utf8_is_served(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    odd = os.path.join(os.fsencode(src), b"caf\xe9.bin")  # Latin-1, not UTF-8
    with open(odd, "wb") as fh:
        fh.write(b"latin-1 name")
    (src / "plain.bin").write_bytes(b"plain")
    files = VolumeDataset(src, cache_dir=tmp_path / "c")
    got = sorted(open(p, "rb").read() for p in files)
    assert got == [b"latin-1 name", b"plain"]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"seed": "1"}, TypeError),
        ({"seed": 1.5}, TypeError),
        ({"seed": -1}, ValueError),
        ({"prefetch": "4"}, TypeError),
        ({"prefetch": 2.0}, TypeError),
        ({"prefetch": True}, TypeError),
        ({"prefetch": 0}, ValueError),
        ({"min_free_bytes": "1GB"}, TypeError),
        ({"min_free_bytes": -1}, ValueError),
        ({"pattern": 3}, TypeError),
        ({"pattern": ""}, ValueError),
    ],
)
def test_wrong_types_and_values_raise_the_matching_error(tmp_path, kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        VolumeDataset(tmp_path, cache_dir=tmp_path / "c", **kwargs)
