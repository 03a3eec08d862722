"""VolumeDataset iterated directly: listing, caching, order, position, bad input."""

from __future__ import annotations

import json
import os
import shutil
import threading

import fsspec
import pytest
from _data_helpers import content, index_of, make_tree

from nbtools.data import VolumeDataset
from nbtools.errors import DataError


def _read(paths):
    return {index_of(p): open(p, "rb").read() for p in paths}


def test_yields_cached_copies_of_every_file_with_their_content(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    got = _read(files)
    assert got == {i: content(i, 64) for i in range(40)}
    assert len(files) == 40
    for path in files:
        assert path.startswith(str(cache)) and not path.startswith(str(src))


def test_second_epoch_is_served_from_the_cache(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    first = list(files)
    shutil.rmtree(src)  # the volume is gone: only the cache can serve epoch 2
    second = list(files)
    assert sorted(first) == sorted(second)
    assert _read(second) == {i: content(i, 64) for i in range(40)}


def test_a_changed_source_file_is_copied_again(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    list(files)
    target = src / "d0" / "f00000.bin"
    target.write_bytes(b"new content")
    fresh = VolumeDataset(src, cache_dir=cache)
    got = {index_of(p): open(p, "rb").read() for p in fresh}
    assert got[0] == b"new content"


def test_pattern_and_hidden_files(tmp_path):
    make_tree(tmp_path / "src", 6)
    (tmp_path / "src" / "d0" / "notes.txt").write_text("x")
    (tmp_path / "src" / ".hidden").mkdir()
    (tmp_path / "src" / ".hidden" / "f99999.bin").write_bytes(b"x")
    (tmp_path / "src" / "d1" / ".f88888.bin").write_bytes(b"x")
    files = VolumeDataset(tmp_path / "src", "**/*.bin", cache_dir=tmp_path / "c")
    assert sorted(index_of(p) for p in files) == list(range(6))
    only_d1 = VolumeDataset(tmp_path / "src", "d1/*.bin", cache_dir=tmp_path / "c")
    assert sorted(index_of(p) for p in only_d1) == [1, 4]


def test_fsspec_url_root(tmp_path):
    fs = fsspec.filesystem("memory")
    for i in range(5):
        fs.pipe(f"/nbtools-test-vol/sub/f{i:05d}.bin", content(i, 100))
    try:
        files = VolumeDataset("memory://nbtools-test-vol", cache_dir=tmp_path / "c")
        assert _read(files) == {i: content(i, 100) for i in range(5)}
    finally:
        fs.rm("/nbtools-test-vol", recursive=True)


def test_bad_roots_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(VolumeDataset(tmp_path / "nope", cache_dir=tmp_path / "c"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no file under .*empty.* matches"):
        list(VolumeDataset(tmp_path / "empty", cache_dir=tmp_path / "c"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        list(VolumeDataset(tmp_path / "file", cache_dir=tmp_path / "c"))
    with pytest.raises(ValueError, match="prefetch"):
        VolumeDataset(tmp_path, prefetch=0)


def test_an_unreadable_file_is_an_error_naming_it(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    len(files)  # listed now; the file vanishes before it is read
    os.unlink(src / "d1" / "f00004.bin")
    with pytest.raises(FileNotFoundError, match=r"f00004\.bin"):
        list(files)


@pytest.mark.timeout(60, method="thread")  # a blocking open would wait for a writer for good
@pytest.mark.parametrize("when", ["after the listing", "before the listing"])
def test_a_fifo_in_place_of_a_file_is_refused_naming_it_never_opened_blocking(tree, when):
    src, cache = tree
    target = src / "d1" / "f00004.bin"
    files = VolumeDataset(src, cache_dir=cache)
    if when == "after the listing":
        len(files)
    target.unlink()
    os.mkfifo(target)  # no writer ever opens it
    with pytest.raises(DataError, match=r"f00004\.bin.* a FIFO \(named pipe\), not a regular file"):
        list(files)
    # Once the file is back, the dataset serves it again.
    target.unlink()
    target.write_bytes(content(4, 64))
    assert sorted(index_of(p) for p in VolumeDataset(src, cache_dir=cache)) == list(range(40))


def test_shuffle_is_a_function_of_seed_and_epoch(tree):
    src, cache = tree

    def order(seed, epoch):
        files = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=seed)
        files.set_epoch(epoch)
        return [index_of(p) for p in files]

    assert order(0, 1) == order(0, 1)
    assert sorted(order(0, 1)) == list(range(40))
    assert order(0, 1) != order(0, 2) and order(0, 1) != order(1, 1)
    unshuffled = [index_of(p) for p in VolumeDataset(src, cache_dir=cache)]
    assert unshuffled == sorted(unshuffled, key=lambda i: (i % 3, i))


def test_epochs_advance_by_themselves_and_set_epoch_keeps_a_position(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache, shuffle=True)
    epoch0 = [index_of(p) for p in files]
    epoch1 = [index_of(p) for p in files]
    assert files.epoch == 1 and epoch0 != epoch1
    files.set_epoch(1)  # epoch 1 is fully seen: nothing is left of it
    assert list(files) == []
    files.set_epoch(0)
    assert [index_of(p) for p in files] == epoch0


def test_direct_iteration_resumes_exactly_and_continues_with_the_same_next_epoch(tree):
    src, cache = tree
    reference = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=5)
    full = [[index_of(p) for p in reference] for _ in range(2)]

    files = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=5)
    seen = []
    for path in files:
        seen.append(index_of(path))
        if len(seen) == 13:
            break
    # The stream that stopped early has joined its source-check thread.
    assert not [t for t in threading.enumerate() if t.name == "nbtools-data-check"]
    state = files.state_dict()
    assert state["epoch"] == 0 and state["prefix"] == 13
    resumed = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    rest = [index_of(p) for p in resumed]
    assert seen + rest == full[0]
    assert [index_of(p) for p in resumed] == full[1]
    # The interrupted dataset itself also continues where its loop stopped.
    assert seen + [index_of(p) for p in files] == full[0]


def test_state_is_plain_and_rejects_another_dataset(tree, tmp_path):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    state = files.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain Python only
    make_tree(tmp_path / "other", 7)
    with pytest.raises(DataError, match="7 files"):
        VolumeDataset(tmp_path / "other", cache_dir=cache).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        VolumeDataset(src, cache_dir=cache, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict"):
        files.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="inconsistent"):
        files.load_state_dict({**state, "prefix": 3, "extras": [2]})


def test_a_position_saved_against_another_listing_or_order_is_refused_not_misread(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache, shuffle=True)
    it = iter(files)
    for _ in range(5):
        next(it)
    it.close()
    state = files.state_dict()
    # Saved by an nbtools whose shuffled order was another permutation.
    with pytest.raises(DataError, match="shuffled order of an earlier nbtools"):
        VolumeDataset(src, cache_dir=cache, shuffle=True).load_state_dict({**state, "version": 1})
    # Unshuffled, the positions of such a state mean the same files: it resumes exactly.
    plain = VolumeDataset(src, cache_dir=cache)
    it = iter(plain)
    seen = [index_of(next(it)) for _ in range(7)]
    it.close()
    old = {**plain.state_dict(), "version": 1}
    resumed = VolumeDataset(src, cache_dir=cache)
    resumed.load_state_dict(old)
    assert sorted(seen + [index_of(p) for p in resumed]) == list(range(40))
    # As many files, one renamed: another listing, whose positions name other files.
    os.rename(src / "d0" / "f00003.bin", src / "d0" / "f00003-renamed.bin")
    with pytest.raises(DataError, match="added, removed or renamed.*leave data= out"):
        VolumeDataset(src, cache_dir=cache, shuffle=True).load_state_dict(state)


@pytest.mark.root
def test_small_cache_filesystem_holds_a_dataset_several_times_larger(tmp_path, small_tmpfs):
    make_tree(tmp_path / "src", 90, size=1 << 20)  # 90 MB through a 30 MB tmpfs
    files = VolumeDataset(tmp_path / "src", cache_dir=small_tmpfs / "cache", prefetch=4)
    threshold = int(0.1 * shutil.disk_usage(small_tmpfs).total)
    for epoch in range(2):
        seen = set()
        for path in files:
            i = index_of(path)
            with open(path, "rb") as fh:
                assert fh.read() == content(i, 1 << 20)
            seen.add(i)
            # One process reserves room before each copy, so free space never dips.
            assert shutil.disk_usage(small_tmpfs).free >= threshold
        assert seen == set(range(90)), f"epoch {epoch}"
        assert shutil.disk_usage(small_tmpfs).free >= threshold


@pytest.mark.parametrize(
    "missing",
    [[17], [82, 338, 594], list(range(3, 601, 37)), [0, 600]],
    ids=["17", "3", "37th", "ends"],
)
def test_cached_runs_across_chunks_with_copies_between_serve_every_file_once_in_order(
    tmp_path, missing
):
    # Runs of cached files are served in bulk; a file to copy after a run that
    # started in an earlier chunk of the listing must still come in its place.
    src, cache = tmp_path / "src", tmp_path / "cache"
    make_tree(src, 601)
    first = list(VolumeDataset(src, cache_dir=cache))
    for k in missing:
        os.remove(first[k])
    files = VolumeDataset(src, cache_dir=cache, prefetch=16)  # a new process's view
    second = list(files)
    assert [index_of(p) for p in second] == [index_of(p) for p in first]
    assert _read(second) == {i: content(i, 64) for i in range(601)}
