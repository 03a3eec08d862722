"""The shared file cache: atomic copies, one copy at a time, eviction, stale temporaries."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time

import pytest
from _data_helpers import content

from nbtools.data._cache._file_cache import TMP_PREFIX, FileCache
from nbtools.errors import CacheError


class _SlowFile:
    """A source that trickles in: each read sleeps (a slow volume, as seen by the cache)."""

    def __init__(self, data: bytes, delay: float, counter: str | None = None) -> None:
        self._data, self._pos, self._delay = data, 0, delay
        if counter:
            with open(counter, "ab") as fh:
                fh.write(b"x")

    def read(self, n: int = -1) -> bytes:
        time.sleep(self._delay)
        n = min(n if n >= 0 else len(self._data), 64 * 1024)
        chunk = self._data[self._pos : self._pos + n]
        self._pos += len(chunk)
        return chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _fetch(cache_dir, key, data, delay, counter=None):
    cache = FileCache(str(cache_dir), min_free_bytes=0)
    pin = cache.fetch(key, len(data), 0, lambda: _SlowFile(data, delay, counter), threading.Event())
    with open(pin.path, "rb") as fh:
        ok = fh.read() == data
    pin.release()
    return ok


def _fetch_forever(cache_dir, data):
    _fetch(cache_dir, "ns/big.bin", data, delay=0.2)


def test_fetch_copies_once_and_hits_afterwards(tmp_path):
    data = content(1, 5000)
    counter = str(tmp_path / "opens")
    assert _fetch(tmp_path / "c", "ns/a/b.bin", data, 0, counter)
    assert _fetch(tmp_path / "c", "ns/a/b.bin", data, 0, counter)
    assert os.path.getsize(counter) == 1
    assert (tmp_path / "c" / "ns" / "a" / "b.bin").read_bytes() == data


def test_parallel_fetches_of_one_file_copy_it_once(tmp_path):
    data = content(2, 300_000)
    counter = str(tmp_path / "opens")
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_fetch, args=(tmp_path / "c", "ns/x.bin", data, 0.01, counter))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(_fetch(tmp_path / "c", "ns/x.bin", data, 0.01, counter))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert results == [True, True, True]
    assert os.path.getsize(counter) == 1


def test_a_copy_killed_midway_leaves_no_complete_looking_file(tmp_path):
    data = content(3, 2_000_000)  # 31 reads of 64 KiB at 0.2 s each: killed long before the end
    cache_dir = tmp_path / "c"
    proc = multiprocessing.get_context("fork").Process(
        target=_fetch_forever, args=(cache_dir, data)
    )
    proc.start()
    deadline = time.monotonic() + 20
    tmp_files: list[str] = []
    while not tmp_files and time.monotonic() < deadline:
        time.sleep(0.05)
        if (cache_dir / "ns").is_dir():
            tmp_files = [n for n in os.listdir(cache_dir / "ns") if n.startswith(TMP_PREFIX)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert tmp_files, "the copy never started"
    assert not (cache_dir / "ns" / "big.bin").exists()
    cache = FileCache(str(cache_dir), min_free_bytes=0)
    assert cache.pin_if_cached("ns/big.bin", len(data), 0) is None
    cache.evict(want_free=1 << 62)  # also sweeps temporaries of dead processes
    assert not [n for n in os.listdir(cache_dir / "ns") if n.startswith(TMP_PREFIX)]
    assert _fetch(cache_dir, "ns/big.bin", data, 0)


def test_cancelled_copy_removes_its_temporary(tmp_path):
    cache = FileCache(str(tmp_path / "c"), min_free_bytes=0)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Exception, match="ns/z.bin"):
        cache.fetch("ns/z.bin", 10, 0, lambda: _SlowFile(b"0123456789", 0), cancel)
    assert os.listdir(tmp_path / "c" / "ns") == []


def test_a_file_larger_than_the_cache_is_a_clear_error(tmp_path):
    total = shutil.disk_usage(tmp_path).total
    cache = FileCache(str(tmp_path / "c"), min_free_bytes=total - 10)
    with pytest.raises(CacheError, match="larger than the cache"):
        cache.fetch("ns/f.bin", 64, 0, lambda: _SlowFile(b"x" * 64, 0), threading.Event())


@pytest.mark.root
def test_eviction_drops_oldest_downloads_and_never_a_pinned_file(small_tmpfs):
    cache = FileCache(str(small_tmpfs / "c"))  # default: keep 10 % (3 MB) free
    mb = 1 << 20
    pins = {}
    held = None
    for i in range(40):
        data = content(i, mb)
        pin = cache.fetch(f"ns/f{i:02d}", mb, 0, lambda d=data: _SlowFile(d, 0), threading.Event())
        assert open(pin.path, "rb").read() == data
        if i == 0:
            held = pin  # the consumer is still using f00
        else:
            pin.release()
        pins[i] = pin.path
        assert shutil.disk_usage(small_tmpfs).free >= cache.min_free
    present = {i for i, p in pins.items() if os.path.exists(p)}
    assert 0 in present, "a pinned file was evicted"
    assert 1 not in present and 39 in present
    # Survivors are the newest downloads (plus the pinned one): no gaps.
    newest = sorted(present - {0})
    assert newest == list(range(newest[0], 40))
    held.release()
