"""Caches smaller than what a stream wants to protect, and the eviction gate."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import threading
import time
import warnings

import pytest
from _data_helpers import content, index_of, make_tree

from nbtools.data import DataLoader, VolumeDataset
from nbtools.data._cache._file_cache import FileCache

MB = 1 << 20


@pytest.mark.root
def test_a_cache_too_small_for_the_prefetch_window_shrinks_it(tmp_path, mount_tmpfs, caplog):
    fs = mount_tmpfs("20m")
    make_tree(tmp_path / "src", 40, size=MB)  # 40 MB through 14 MB of usable cache
    floor = 6 * MB
    files = VolumeDataset(tmp_path / "src", cache_dir=fs / "cache", min_free_bytes=floor)
    assert files.prefetch == 16  # the default, more than the cache can hold
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        for epoch in range(2):
            seen = set()
            for path in files:
                with open(path, "rb") as fh:
                    assert fh.read() == content(index_of(path), MB)
                seen.add(index_of(path))
                assert shutil.disk_usage(fs).free >= floor
            assert seen == set(range(40)), f"epoch {epoch}"
    warnings = [r.getMessage() for r in caplog.records if "copying ahead" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert re.search(r"copying ahead \d+ files instead of prefetch=16", warnings[0])
    # Only a single file larger than the whole cache is an error.
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "f99999.bin").write_bytes(b"x" * (15 * MB))
    big = VolumeDataset(tmp_path / "big", cache_dir=fs / "cache", min_free_bytes=floor)
    with pytest.raises(OSError, match=r"f99999\.bin .* is larger than the cache"):
        list(big)


def _check_paths(loader, n, delay):
    got = set()
    for batch in loader:
        for path in batch:
            time.sleep(delay)  # the loop works while the workers run ahead
            with open(path, "rb") as fh:  # FileNotFoundError if evicted too early
                assert fh.read() == content(index_of(path), 2 * MB)
            got.add(index_of(path))
    assert got == set(range(n))


@pytest.mark.root
def test_paths_handed_to_the_training_loop_stay_readable(tmp_path, mount_tmpfs):
    fs = mount_tmpfs("16m")
    make_tree(tmp_path / "src", 24, size=2 * MB)  # 48 MB through a 16 MB cache
    files = VolumeDataset(tmp_path / "src", cache_dir=fs / "cache", prefetch=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DataLoader(files, num_workers=2, collate_fn=list) as loader:
            _check_paths(loader, 24, 0.05)
            _check_paths(loader, 24, 0.0)
    told = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert any("prefetches 1 batches per worker" in m for m in told), told


@pytest.mark.root
def test_a_loader_that_cannot_keep_its_batches_readable_says_so(tmp_path, mount_tmpfs):
    fs = mount_tmpfs("16m")
    make_tree(tmp_path / "src", 8, size=2 * MB)
    files = VolumeDataset(tmp_path / "src", cache_dir=fs / "cache")
    with DataLoader(files, batch_size=4, num_workers=2, collate_fn=list) as loader:
        with pytest.raises(OSError, match="at least two batches of 4 readable"):
            iter(loader)


def _fill_cache(cache_dir: str, start: int, n: int, floor: int) -> None:
    cache = FileCache(cache_dir, min_free_bytes=floor)
    for i in range(start, start + n):
        data = content(i, MB)
        pin = cache.fetch(f"other/f{i:05d}.bin", MB, 0, lambda d=data: _Src(d), threading.Event())
        pin.release()


class _Src:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, n: int = -1) -> bytes:
        chunk, self.data = self.data[: max(n, 0) or None], self.data[max(n, 0) or len(self.data) :]
        return chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _flocks_on(path: str) -> int:
    """How many ``flock`` locks are held on ``path`` (from ``/proc/locks``)."""
    st = os.stat(path)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    with open("/proc/locks") as fh:
        return sum(1 for line in fh if "FLOCK" in line and where in line)


@pytest.mark.root
def test_an_idle_stream_yields_to_eviction_and_keeps_its_file(tmp_path, mount_tmpfs):
    fs = mount_tmpfs("20m")
    cache_dir = str(fs / "cache")
    make_tree(tmp_path / "src", 12, size=MB)
    files = VolumeDataset(tmp_path / "src", cache_dir=cache_dir, prefetch=2, min_free_bytes=2 * MB)
    list(files)  # every file cached: the next epoch is served by hits
    it = iter(files)
    held = next(it)
    # Served from the cache without a lock of its own: the stream holds the gate.
    assert _flocks_on(held) == 0
    assert _flocks_on(os.path.join(cache_dir, ".locks", "gate")) == 1
    # Another process (forked now: it must not inherit the gate) needs room
    # while this stream sits idle at ``held``.
    proc = multiprocessing.get_context("fork").Process(
        target=_fill_cache, args=(cache_dir, 1000, 14, 2 * MB)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    # The idle stream switched to a pin: its file survived, others were evicted.
    assert _flocks_on(held) == 1
    with open(held, "rb") as fh:
        assert fh.read() == content(index_of(held), MB)
    namespace = os.path.dirname(os.path.dirname(held))
    cached = [os.path.join(namespace, f"d{i % 3}", f"f{i:05d}.bin") for i in range(12)]
    assert not all(os.path.exists(p) for p in cached)
    rest = [index_of(p) for p in it]
    assert sorted(rest + [index_of(held)]) == list(range(12))


def _evict_everything(cache_dir: str) -> None:
    cache = FileCache(cache_dir)
    cache.evict(shutil.disk_usage(cache_dir).total + 1)  # more free space than there can be


def test_files_another_process_evicted_are_copied_again_not_trusted_from_memory(tmp_path):
    make_tree(tmp_path / "src", 9, size=4096)
    cache_dir = str(tmp_path / "cache")
    files = VolumeDataset(tmp_path / "src", cache_dir=cache_dir, prefetch=2)
    for _ in range(2):  # copied, then served as hits: this process knows every file is there
        assert sorted(index_of(p) for p in files) == list(range(9))
    generation = FileCache(cache_dir).gate.generation()
    proc = multiprocessing.get_context("fork").Process(target=_evict_everything, args=(cache_dir,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert FileCache(cache_dir).gate.generation() == generation + 1  # the eviction is counted
    seen = []
    for path in files:  # FileNotFoundError if a hit were trusted past the eviction
        with open(path, "rb") as fh:
            assert fh.read() == content(index_of(path), 4096)
        seen.append(index_of(path))
    assert sorted(seen) == list(range(9))


@pytest.mark.root
@pytest.mark.timeout(60, method="thread")  # a wait for space that cannot come would take minutes
def test_a_cache_filesystem_filled_by_another_program_is_said_at_once(tmp_path, mount_tmpfs):
    fs = mount_tmpfs("50m")
    make_tree(tmp_path / "src", 5, size=2 * MB)
    # Another program takes all but 2.5 MB: a 2 MB file and the 1 MB floor do not fit,
    # even with every cached file evicted.
    filler = fs / "someone-elses-file"
    with open(filler, "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, shutil.disk_usage(fs).free - 5 * MB // 2)
    with pytest.raises(OSError) as caught:
        list(VolumeDataset(tmp_path / "src", cache_dir=fs / "cache", min_free_bytes=MB))
    text = str(caught.value)
    assert f"in the cache at {str(fs / 'cache')!r}" in text, text
    assert re.search(r"has \d+ bytes free and \d+ are needed", text), text
    assert re.search(r"the cache's own files hold \d+ bytes there, other files \d+ bytes", text)
    assert "NBTOOLS_CACHE_MIN_FREE_BYTES" in text and "NBTOOLS_CACHE_DIR" in text
    assert "every cached file is in use" not in text
    filler.unlink()  # the space is back: the same call serves every file
    files = VolumeDataset(tmp_path / "src", cache_dir=fs / "cache", min_free_bytes=MB)
    assert sorted(index_of(p) for p in files) == list(range(5))
