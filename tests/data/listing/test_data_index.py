"""The dataset index: reused while fresh, rebuilt when the volume changed, never trusted blindly."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import struct
import time
import zlib

import pytest
from _data_helpers import content, index_of

from nbtools.data import VolumeDataset
from nbtools.data._listing import _catalog
from nbtools.data._listing._catalog import index_path, load_index
from nbtools.data._listing._index import IndexWriter, open_index


def _backdate(root) -> None:
    """Make every directory look written an hour ago (an index of it can be reused)."""
    past = time.time() - 3600
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (past, past))


def _index_file(src, cache) -> str:
    return index_path(str(cache), str(src), "**/*")


def _served(files) -> dict[int, bytes]:
    return {index_of(p): open(p, "rb").read() for p in files}


def _listings(caplog) -> int:
    return sum(1 for r in caplog.records if r.getMessage().startswith("listed "))


@pytest.fixture
def volume(tree):
    src, cache = tree
    _backdate(src)
    return src, cache


def test_a_later_dataset_reuses_the_index_and_sees_a_changed_volume(volume, caplog):
    src, cache = volume
    caplog.set_level("INFO", logger="nbtools")
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert _listings(caplog) == 1, "an unchanged volume is listed once"
    (src / "d1" / "f00040.bin").write_bytes(content(40, 64))  # added: d1 changes
    files = VolumeDataset(src, cache_dir=cache)
    assert _served(files) == {i: content(i, 64) for i in range(41)}
    assert _listings(caplog) == 2
    os.unlink(src / "d2" / "f00002.bin")  # removed
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert _listings(caplog) == 3


def test_refresh_lists_again_and_a_file_replaced_by_rename_is_seen(volume, caplog):
    src, cache = volume
    caplog.set_level("INFO", logger="nbtools")
    list(VolumeDataset(src, cache_dir=cache))
    VolumeDataset(src, cache_dir=cache, refresh=True).__len__()
    assert _listings(caplog) == 2
    _backdate(src)
    new = src / "d0" / "tmp-new"
    new.write_bytes(b"replaced")
    os.replace(new, src / "d0" / "f00000.bin")  # a writer's usual atomic replace
    assert _served(VolumeDataset(src, cache_dir=cache))[0] == b"replaced"


def test_a_file_rewritten_in_place_under_a_reused_index_is_copied_again(volume):
    src, cache = volume
    list(VolumeDataset(src, cache_dir=cache))
    (src / "d1" / "f00001.bin").write_bytes(b"rewritten in place, longer")
    _backdate(src)  # the directory looks unchanged: the index is reused
    assert _served(VolumeDataset(src, cache_dir=cache))[1] == b"rewritten in place, longer"


def _flip(path: str, where: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _rewrite_header(path: str, change) -> None:
    with open(path, "rb") as fh:
        data = fh.read()
    magic, length, _ = struct.unpack_from("<8sQQ", data, 0)
    text = data[24 : 24 + length]
    header = json.loads(text)
    change(header)
    new = json.dumps(header).encode().ljust(length)[:length]
    with open(path, "wb") as fh:
        fh.write(struct.pack("<8sQQ", magic, length, zlib.crc32(new)) + new + data[24 + length :])


@pytest.mark.parametrize(
    "damage",
    ["flipped path byte", "truncated", "other format", "writable by others", "garbage"],
)
def test_a_damaged_or_foreign_index_is_rebuilt_with_a_warning(volume, damage, monkeypatch):
    src, cache = volume
    monkeypatch.setattr(_catalog, "_RACY_NS", 0)  # an index built long ago
    list(VolumeDataset(src, cache_dir=cache))
    path = _index_file(src, cache)
    # The next opens on the node check only its header: this version is noted as
    # checked. A damaged file is another version, checked in full again.
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert os.path.exists(path + ".checked")
    time.sleep(0.02)  # the damage lands in a later clock tick
    size = os.path.getsize(path)
    if damage == "flipped path byte":
        _flip(path, size - 200)
    elif damage == "truncated":
        os.truncate(path, size // 2)
    elif damage == "other format":
        _rewrite_header(path, lambda h: h.update(format=9))
    elif damage == "writable by others":
        os.chmod(path, 0o666)
    else:
        with open(path, "wb") as fh:
            fh.write(os.urandom(size))
    with pytest.warns(RuntimeWarning, match="not using the dataset index"):
        files = VolumeDataset(src, cache_dir=cache)
        assert _served(files) == {i: content(i, 64) for i in range(40)}
    assert len(open_index(path, str(src), "**/*")) == 40  # a good one replaced it


@pytest.mark.root
def test_an_index_owned_by_another_user_is_refused(volume):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    src, cache = volume
    list(VolumeDataset(src, cache_dir=cache))
    path = _index_file(src, cache)
    os.chown(path, 65534, 65534)
    with pytest.warns(RuntimeWarning, match="belongs to uid 65534"):
        assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert os.stat(path).st_uid == os.getuid()


def test_an_index_naming_paths_outside_the_root_is_refused(volume, tmp_path):
    src, cache = volume
    (tmp_path / "secret").write_bytes(b"not part of the dataset")
    list(VolumeDataset(src, cache_dir=cache))
    path = _index_file(src, cache)
    for rel in (b"../secret", b"d0/../../secret", b"/etc/passwd"):
        writer = IndexWriter(path, str(src), "**/*", {"job": "x", "checkable": True})
        writer.add_dir(b"", os.stat(src).st_mtime_ns)
        writer.add_file(rel, 23, 0)
        writer.commit()
        with pytest.warns(RuntimeWarning, match="outside the root"):
            got = _served(VolumeDataset(src, cache_dir=cache))
        assert got == {i: content(i, 64) for i in range(40)}


def _build(args) -> tuple[int, str]:
    src, cache, token = args
    index = load_index(src, "**/*", cache, True, token, in_root=True)
    return len(index), index.fingerprint


def test_concurrent_builders_leave_one_complete_index(tree):
    src, cache = tree
    # Two nodes (private caches), each with several builders, all writing to the root too.
    jobs = [(str(src), f"{cache}-{i % 2}", f"job-{i}") for i in range(12)]
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_build, jobs)
    assert {r[0] for r in results} == {40}
    assert len({r[1] for r in results}) == 1
    for where in (_index_file(src, f"{cache}-0"), _shared_index(src)):
        index = open_index(where, str(src), "**/*")
        assert len(index) == 40
        name = os.path.basename(index.path)
        leftovers = [
            n for n in os.listdir(os.path.dirname(index.path)) if n not in (name, f"{name}.checked")
        ]
        assert leftovers == []


@pytest.mark.slow
def test_a_million_entry_index_maps_without_a_python_object_per_file(tmp_path):
    import tracemalloc

    path = str(tmp_path / "big.idx")
    writer = IndexWriter(path, "/vol", "**/*", {"job": "x", "checkable": True})
    writer.add_dir(b"", 0)
    for i in range(1_000_000):
        writer.add_file(b"d%03d/f%07d.jpg" % (i % 1000, i), 1000 + i, i)
    writer.commit()
    tracemalloc.start()
    try:
        index = open_index(path, "/vol", "**/*")
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == 1_000_000
    assert index.relpath(765_432) == "d432/f0765432.jpg" and index.sizes[765_432] == 766_432
    assert kept < 1_000_000  # under a byte per file kept privately; the rest is the map


def _shared_index(src) -> str:
    from nbtools.data._listing._shared_index import shared_path

    return shared_path(str(src), "**/*")


def test_an_index_kept_in_the_root_serves_the_volume_mounted_at_another_path(
    volume, tmp_path, caplog
):
    src, _ = volume
    caplog.set_level("INFO", logger="nbtools")
    assert len(VolumeDataset(src, cache_dir=tmp_path / "node-a", index_in_root=True)) == 40
    listed = _listings(caplog)
    # Another node mounts the same volume elsewhere: it uses the index, lists nothing.
    elsewhere = tmp_path / "mnt" / "data"
    elsewhere.parent.mkdir()
    elsewhere.symlink_to(src, target_is_directory=True)
    files = VolumeDataset(elsewhere, cache_dir=tmp_path / "node-b", index_in_root=True)
    assert _served(files) == {i: content(i, 64) for i in range(40)}
    index = load_index(str(elsewhere), "**/*", str(tmp_path / "node-b"), False, "t", in_root=True)
    assert index.source(0).startswith(str(elsewhere) + "/")  # read through this node's path
    assert _listings(caplog) == listed
    # A change seen through the other path is seen there too.
    (src / "d1" / "f00040.bin").write_bytes(content(40, 64))
    assert len(VolumeDataset(elsewhere, cache_dir=tmp_path / "node-b", index_in_root=True)) == 41
    assert _listings(caplog) == listed + 1


def test_an_index_kept_in_the_root_is_shared_by_other_nodes_and_checked(volume, tmp_path, caplog):
    src, cache = volume
    caplog.set_level("INFO", logger="nbtools")
    node_a, node_b, node_c = (tmp_path / f"cache-{n}" for n in "abc")
    # The first launch creates .nbtools-index and sets the root's time back: the index
    # made before it, and the one made with it, stay fresh.
    root_mtime = os.stat(src).st_mtime_ns
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert len(VolumeDataset(src, cache_dir=node_a, index_in_root=True)) == 40
    assert os.stat(src).st_mtime_ns == root_mtime
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    assert len(VolumeDataset(src, cache_dir=node_a, index_in_root=True)) == 40
    assert _listings(caplog) == 2
    # Another node, with an empty private cache: it copies the index, lists nothing.
    files = VolumeDataset(src, cache_dir=node_b, index_in_root=True)
    assert _served(files) == {i: content(i, 64) for i in range(40)}
    assert _listings(caplog) == 2
    assert "using the dataset index" in caplog.text
    assert all(".nbtools-index" not in p for p in files)  # the index is not a sample
    # An index in the root naming a path outside it is refused, rebuilt and replaced.
    shared = _shared_index(src)
    writer = IndexWriter(shared, str(src), "**/*", {"job": "x", "checkable": True})
    writer.add_dir(b"", os.stat(src).st_mtime_ns)
    writer.add_file(b"../secret", 23, 0)
    writer.commit()
    os.chmod(shared, 0o644)
    with pytest.warns(RuntimeWarning, match=r"\.nbtools-index.*outside the root"):
        assert len(VolumeDataset(src, cache_dir=node_c, index_in_root=True)) == 40
    assert len(open_index(shared, str(src), "**/*")) == 40
    # One that others can write to is not even read.
    os.chmod(shared, 0o666)
    with pytest.warns(RuntimeWarning, match="other users can write to it"):
        assert len(VolumeDataset(src, cache_dir=tmp_path / "cache-d", index_in_root=True)) == 40
    with pytest.raises(ValueError, match="index_in_root=True needs a local directory"):
        len(VolumeDataset("memory://nbtools-no-such-root", cache_dir=cache, index_in_root=True))


@pytest.mark.root
def test_an_index_that_does_not_fit_names_its_directory_and_leaves_nothing(tmp_path, mount_tmpfs):
    from nbtools.errors import CacheError

    src = tmp_path / "src"
    for d in range(4):
        (src / f"dir{d}").mkdir(parents=True)
        for i in range(1000):
            (src / f"dir{d}" / f"a-rather-long-file-name-{i:05d}.bin").write_bytes(b"")
    fs = mount_tmpfs("50m")
    cache = fs / "cache"
    # Another program fills the filesystem but for 64 KB: the index needs about 200 KB.
    filler = fs / "someone-elses-file"
    with open(filler, "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, shutil.disk_usage(fs).free - (64 << 10))
    with pytest.raises(CacheError) as caught:
        len(VolumeDataset(src, cache_dir=cache))
    text = str(caught.value)
    assert f"in {str(cache / '.index')!r}: no space left" in text, text
    assert re.search(
        r"needs (about|more than) \d+ bytes while it is written and \d+ bytes are free", text
    )
    assert "cache_dir=" in text and "NBTOOLS_CACHE_DIR" in text
    assert os.listdir(cache / ".index") == [], "nothing half-written is left"
    filler.unlink()  # the space is back: the same call works
    assert len(VolumeDataset(src, cache_dir=cache)) == 4000


def _make_racy(path, at_ns: int) -> None:
    """Give the directory ``path`` the modification time ``at_ns``, as a write then would."""
    os.utime(path, ns=(at_ns, at_ns))


class _CountingScans:
    """Counts the directories listed in this process (``os.scandir`` calls)."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[str] = []
        real = os.scandir

        def scandir(path="."):
            self.paths.append(os.fspath(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)


def test_a_volume_written_just_before_its_listing_is_rechecked_only_where_recent(
    volume, caplog, monkeypatch
):
    src, cache = volume
    caplog.set_level("INFO", logger="nbtools")
    now = time.time_ns()
    _make_racy(src / "d1", now)  # written in the second before the first listing
    assert len(VolumeDataset(src, cache_dir=cache)) == 40
    built = os.stat(_index_file(src, cache)).st_ino
    scans = _CountingScans(monkeypatch)
    assert len(VolumeDataset(src, cache_dir=cache)) == 40  # a later launch
    assert _listings(caplog) == 1, "the index is reused"
    assert os.stat(_index_file(src, cache)).st_ino == built
    assert scans.paths == [str(src / "d1")], "only the recent directory is listed again"
    # A file added to it within the same clock tick (its time unchanged) is seen.
    (src / "d1" / "f00040.bin").write_bytes(content(40, 64))
    _make_racy(src / "d1", now)
    assert _served(VolumeDataset(src, cache_dir=cache)) == {i: content(i, 64) for i in range(41)}
    assert _listings(caplog) == 2
    # So is a file rewritten in the same tick (another size, the same time), and a
    # new subdirectory.
    before = os.stat(src / "d1" / "f00040.bin").st_mtime_ns
    (src / "d1" / "f00040.bin").write_bytes(content(40, 65))
    os.utime(src / "d1" / "f00040.bin", ns=(before, before))
    _make_racy(src / "d1", now)
    assert len(VolumeDataset(src, cache_dir=cache)) == 41
    assert _listings(caplog) == 3
    (src / "d1" / "sub").mkdir()
    (src / "d1" / "sub" / "f00041.bin").write_bytes(content(41, 64))
    _make_racy(src / "d1", now)
    assert len(VolumeDataset(src, cache_dir=cache)) == 42
    assert _listings(caplog) == 4


def _make_million(root, racy: int) -> list:
    """1,000,000 empty files in 1,000 directories, written long ago but for the last ``racy``.

    A directory's other 999 files are hard links to its first: a million directory entries,
    each listed as a file of its own, without a million inodes, which a journalling
    filesystem creates far more slowly than links (minutes against seconds on a busy disk).
    """
    past = time.time() - 3600
    dirs = []
    for d in range(1000):
        path = root / f"d{d:04d}"
        path.mkdir(parents=True)
        first = path / f"f{d * 1000:07d}.bin"
        os.close(os.open(first, os.O_CREAT | os.O_WRONLY, 0o644))
        for i in range(1, 1000):
            os.link(first, path / f"f{d * 1000 + i:07d}.bin")
        dirs.append(path)
    for path in dirs[:-racy]:
        os.utime(path, (past, past))
    return dirs[-racy:]


@pytest.mark.slow
def test_the_second_launch_of_a_million_files_written_just_before_the_first_is_warm(
    tmp_path, memory_volume, caplog, monkeypatch
):
    src, cache = memory_volume / "src", tmp_path / "cache"
    racy = _make_million(src, racy=3)
    now = time.time_ns()
    for path in (*racy, src):
        _make_racy(path, now)
    caplog.set_level("INFO", logger="nbtools")
    assert len(VolumeDataset(src, cache_dir=cache)) == 1_000_000
    scans = _CountingScans(monkeypatch)
    assert len(VolumeDataset(src, cache_dir=cache)) == 1_000_000  # the second launch
    assert _listings(caplog) == 1
    assert sorted(scans.paths) == sorted([str(src), *map(str, racy)])
