"""A local file cache shared by every worker and rank on one node.

Layout: ``<cache_dir>/<namespace>/<relative path>`` holds complete copies;
``<cache_dir>/.locks/`` holds empty lock files. Coordination uses ``flock``
(standard library, local filesystems), never shared memory, so an interrupted
or killed process leaves nothing that needs cleaning besides a temporary file,
which the next eviction pass removes.

Invariants:

* A copy is written to ``.nbtools-tmp-<pid>-<random>`` in the target directory
  and moved onto its final name with ``os.replace`` only when complete, so a
  final name always holds a complete file.
* Whoever uses a cached file holds a shared ``flock`` on it (a *pin*). Eviction
  deletes a file only after taking an exclusive, non-blocking ``flock`` on it,
  so a pinned file is never evicted.
* A per-file lock serialises copies of the same file: no file is copied twice
  at the same time, by any process on the node.
* The cached file's modification time is the source's, so a changed source is
  copied again; its ``ctime`` is the time of download, which orders eviction.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from nbtools._internal.fs import pid_alive
from nbtools._internal.log import get_logger
from nbtools.errors import CacheError

__all__ = ["Cancelled", "FileCache", "Pin", "default_cache_dir", "min_free_from_env", "TMP_PREFIX"]

_log = get_logger("data.cache")

TMP_PREFIX = ".nbtools-tmp-"
_LOCKS = ".locks"
_CHUNK = 1 << 20
_SPACE_WAIT_S = 120.0
_ENV_NAMES = ("NBTOOLS_CACHE_MIN_FREE_BYTES", "SGC_FSLAYER_MIN_FREE_DISK_BYTES")

# Bytes promised to copies in progress in this process, per cache directory, so
# that parallel copy threads do not all see the same free space and overshoot.
_RESERVED: dict[str, int] = {}
_RESERVED_LOCK = threading.Lock()


class Cancelled(Exception):
    """A copy was abandoned because its consumer went away."""


def default_cache_dir() -> str:
    """A per-user directory under the system temporary directory."""
    return os.path.join(tempfile.gettempdir(), f"nbtools-cache-{os.getuid()}")


def min_free_from_env() -> int | None:
    """The free-space threshold from the environment, or None when unset."""
    for name in _ENV_NAMES:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                parsed = int(value)
            except ValueError:
                raise ValueError(
                    f"{name}={value!r} must be a number of bytes, e.g. 10000000000"
                ) from None
            if parsed < 0:
                raise ValueError(f"{name}={value!r} must not be negative")
            return parsed
    return None


class Pin:
    """A shared lock on a cached file: while it is held the file is not evicted."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Let the file be evicted again (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the descriptor drops its flock


def _still_linked(fd: int) -> os.stat_result | None:
    """``fstat(fd)`` unless the file was unlinked (evicted or replaced) meanwhile.

    Cache files are never renamed or hard-linked once in place, so a file that
    still has a link is still the one under its path.
    """
    st = os.fstat(fd)
    return st if st.st_nlink > 0 else None


class FileCache:
    """Complete local copies of remote files, evicted oldest-download first.

    Args:
        cache_dir: Directory of the cache (created if needed).
        min_free_bytes: Keep at least this much free on the cache filesystem;
            None reads the environment, else 10 % of the filesystem.
    """

    def __init__(self, cache_dir: str, min_free_bytes: int | None = None) -> None:
        self.dir = os.path.abspath(cache_dir)
        try:
            os.makedirs(os.path.join(self.dir, _LOCKS), mode=0o700, exist_ok=True)
        except OSError as exc:
            raise CacheError(
                exc.errno,
                f"cannot create the cache directory {self.dir!r}: {exc.strerror}; "
                "pass cache_dir= on a writable local disk",
            ) from exc
        usage = shutil.disk_usage(self.dir)
        if min_free_bytes is None:
            min_free_bytes = min_free_from_env()
        if min_free_bytes is None:
            min_free_bytes = usage.total // 10
        self.min_free = int(min_free_bytes)
        self._total = usage.total

    # --- lookups and copies -------------------------------------------------------

    def path_for(self, key: str) -> str:
        """Final path of ``key`` (``namespace/relative/path``) in the cache."""
        return f"{self.dir}/{key}" if os.sep == "/" else os.path.join(self.dir, *key.split("/"))

    def pin_if_cached(self, key: str, size: int, mtime_ns: int) -> Pin | None:
        """A pin on the complete, up-to-date copy of ``key``, or None on a miss."""
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = _still_linked(fd)
            if (
                st is not None
                and st.st_size == size
                and (not mtime_ns or st.st_mtime_ns == mtime_ns)
            ):
                return Pin(path, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def fetch(
        self,
        key: str,
        size: int,
        mtime_ns: int,
        opener: Callable[[], IO[bytes]],
        cancel: threading.Event,
        wait_for_space: bool = True,
    ) -> Pin | None:
        """Pin the cached copy of ``key``, copying it from ``opener()`` on a miss.

        Returns None only when ``wait_for_space`` is False and the cache has no
        room for the file right now.

        Raises:
            CacheError: the file is larger than the cache can ever hold, or no
                room appeared within two minutes.
            Cancelled: ``cancel`` was set during the copy.
        """
        pin = self.pin_if_cached(key, size, mtime_ns)
        if pin is not None:
            return pin
        lock_path = os.path.join(self.dir, _LOCKS, hashlib.sha1(key.encode()).hexdigest())
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            # Another worker may have copied it while this one waited.
            pin = self.pin_if_cached(key, size, mtime_ns)
            if pin is not None:
                return pin
            if not self._make_room(key, size, wait_for_space, cancel):
                return None
            try:
                return self._copy(key, mtime_ns, opener, cancel)
            finally:
                with _RESERVED_LOCK:
                    _RESERVED[self.dir] -= size
        finally:
            os.close(lock_fd)

    def _copy(
        self, key: str, mtime_ns: int, opener: Callable[[], IO[bytes]], cancel: threading.Event
    ) -> Pin:
        path = self.path_for(key)
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            with opener() as src, open(tmp, "wb") as dst:
                while True:
                    if cancel.is_set():
                        raise Cancelled(key)
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    dst.write(chunk)
            if mtime_ns:
                os.utime(tmp, ns=(mtime_ns, mtime_ns))
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return Pin(path, fd)

    # --- space ----------------------------------------------------------------------

    def _make_room(self, key: str, size: int, wait: bool, cancel: threading.Event) -> bool:
        if size > self._total - self.min_free:
            raise CacheError(
                errno.ENOSPC,
                f"{key} ({size} bytes) is larger than the cache at {self.dir!r} can hold "
                f"({self._total} bytes, of which {self.min_free} are kept free); "
                "use a cache_dir on a larger filesystem or lower min_free_bytes",
            )
        deadline = time.monotonic() + _SPACE_WAIT_S
        delay = 0.01
        while True:
            if self._reserve(size):
                return True
            margin = min(max(self._total // 50, size), 1 << 30)
            self.evict(self.min_free + size + margin + _RESERVED.get(self.dir, 0))
            if self._reserve(size):
                return True
            if not wait:
                return False
            if cancel.is_set():
                raise Cancelled(key)
            if time.monotonic() > deadline:
                raise CacheError(
                    errno.ENOSPC,
                    f"no room for {key} in the cache at {self.dir!r}: every cached file is in "
                    "use; use fewer workers or a smaller prefetch, or a larger cache filesystem",
                )
            time.sleep(delay)  # files in use by other streams are released as they advance
            delay = min(delay * 2, 0.5)

    def _reserve(self, size: int) -> bool:
        with _RESERVED_LOCK:
            reserved = _RESERVED.get(self.dir, 0)
            if shutil.disk_usage(self.dir).free - reserved - size < self.min_free:
                return False
            _RESERVED[self.dir] = reserved + size
            return True

    def evict(self, want_free: int) -> int:
        """Delete unpinned files, oldest download first, until ``want_free`` bytes are free.

        Also removes temporary files of processes that no longer exist. Returns
        the number of files deleted. Only one process evicts at a time; the
        others return at once and recheck the free space.
        """
        guard = os.open(
            os.path.join(self.dir, _LOCKS, "evict"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            candidates = self._scan()
            removed = 0
            for _, path in sorted(candidates):
                if shutil.disk_usage(self.dir).free >= want_free:
                    break
                if self._evict_one(path):
                    removed += 1
            if removed:
                _log.debug("evicted %d files from %s", removed, self.dir)
            return removed
        finally:
            os.close(guard)

    def _scan(self) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []
        for dirpath, dirnames, filenames in os.walk(self.dir):
            if dirpath == self.dir:
                dirnames[:] = [d for d in dirnames if d != _LOCKS]
            for name in filenames:
                path = os.path.join(dirpath, name)
                if name.startswith(TMP_PREFIX):
                    self._remove_stale_tmp(path, name)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    found.append((os.stat(path).st_ctime_ns, path))
        return found

    @staticmethod
    def _remove_stale_tmp(path: str, name: str) -> None:
        try:
            pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
        except ValueError:
            return
        if not pid_alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    @staticmethod
    def _evict_one(path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # pinned: in use by a consumer or about to be served
            if _still_linked(fd) is None:
                return False
            os.unlink(path)
            return True
        finally:
            os.close(fd)
