"""Walking the cache: eviction candidates, leftover temporaries, and deleting one file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from nbtools._internal.fs import TMP_PREFIX, pid_alive
from nbtools.data._cache._pins import still_linked

__all__ = ["cached_bytes", "evict_one", "scan", "sweep_due", "sweep_temporaries"]


def _remove_stale_tmp(path: str, name: str) -> bool:
    """Remove a temporary file whose copying process no longer exists."""
    try:
        pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return False
    if pid_alive(pid):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        return True
    return False


def _walk(cache_dir: str, skip: str | tuple[str, ...]):
    skips = (skip,) if isinstance(skip, str) else skip
    for dirpath, dirnames, filenames in os.walk(cache_dir):
        if dirpath == cache_dir:
            dirnames[:] = [d for d in dirnames if d not in skips]
        for name in filenames:
            yield dirpath, name


def sweep_due(locks_dir: str, every_s: float) -> bool:
    """True for the one process that should sweep now: none swept in the last ``every_s``.

    The time of the last sweep is the mtime of ``<locks_dir>/swept``; a process
    that finds another one deciding at the same moment leaves it to that one.
    """
    stamp = os.path.join(locks_dir, "swept")
    fd = os.open(stamp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        st = os.fstat(fd)
        now = time.time()
        if st.st_size and 0 <= now - st.st_mtime < every_s:
            return False
        os.pwrite(fd, b"1", 0)  # a stamp that exists was written by a sweep
        os.utime(fd, (now, now))
        return True
    finally:
        os.close(fd)


def sweep_temporaries(cache_dir: str, skip: str | tuple[str, ...]) -> int:
    """Remove the temporaries of dead processes under ``cache_dir`` (not under ``skip``)."""
    removed = 0
    for dirpath, name in _walk(cache_dir, skip):
        if name.startswith(TMP_PREFIX):
            removed += _remove_stale_tmp(os.path.join(dirpath, name), name)
    return removed


def scan(cache_dir: str, skip: str | tuple[str, ...]) -> list[tuple[int, str]]:
    """``(download time, path)`` of every cached file; also sweeps leftover temporaries."""
    found: list[tuple[int, str]] = []
    for dirpath, name in _walk(cache_dir, skip):
        path = os.path.join(dirpath, name)
        if name.startswith(TMP_PREFIX):
            _remove_stale_tmp(path, name)
            continue
        with contextlib.suppress(FileNotFoundError):
            found.append((os.stat(path).st_ctime_ns, path))
    return found


def cached_bytes(cache_dir: str, skip: str | tuple[str, ...]) -> int:
    """Bytes the cached files and copies in progress take on disk (not under ``skip``)."""
    total = 0
    for dirpath, name in _walk(cache_dir, skip):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def evict_one(path: str) -> bool:
    """Delete ``path`` unless it is pinned; True when it was deleted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # pinned: in use by a consumer or about to be served
        if still_linked(fd) is None:
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)
