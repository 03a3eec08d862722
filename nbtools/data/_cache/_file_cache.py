"""A local file cache shared by every worker and rank on one node.

Layout: ``<cache_dir>/<namespace>/<relative path>`` holds complete copies;
``<cache_dir>/.locks/`` holds lock files. Coordination uses ``flock``
(standard library, local filesystems), never ``/dev/shm``, so an interrupted
or killed process leaves nothing that needs cleaning besides a temporary file,
which the next process to open the cache removes. The cache directory is
private to its user (see ``_location``).

Invariants:

* A copy is written to ``.nbtools-tmp-<pid>-<random>`` in the target directory
  and moved onto its final name with ``os.replace`` only when complete, so a
  final name always holds a complete file.
* Whoever uses a cached file holds a shared ``flock`` on it (a *pin*), or holds
  the cache-wide gate (see ``_gate``). Eviction runs only while it holds the
  gate exclusively, and deletes a file only after taking an exclusive,
  non-blocking ``flock`` on it, so a file in use is never evicted.
* A per-file lock serialises copies of the same file: no file is copied twice
  at the same time, by any process on the node.
* The cached file's modification time is the source's, so a changed source is
  copied again; its ``ctime`` is the time of download, which orders eviction.
* Only eviction deletes complete files, and it counts itself in the gate: a
  process remembers which files it saw complete until the count moves, and
  serves those without a ``stat`` (so a file deleted by hand from a cache in
  use is an error in the reader, not a new copy, until the next eviction).

A volume is shared storage: a file can be replaced or grow while a node copies it. A copy
counts only when it holds exactly the listed bytes of a source that did not change while it
was read (its size and modification time are checked before and after it is read); anything
else is :class:`SourceChanged`, which the cache answers by copying again (a few times) and
then by an error naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from nbtools._internal.fs import TMP_PREFIX
from nbtools._internal.log import get_logger
from nbtools.data._cache._gate import Gate, KnownFiles
from nbtools.data._cache._location import (
    ENV_DIR,
    ENV_MIN_FREE,
    ensure_private_dir,
    min_free_from_env,
)
from nbtools.data._cache._pins import Cancelled, Pin, pin_path
from nbtools.data._cache._sweep import cached_bytes, evict_one, scan, sweep_due, sweep_temporaries
from nbtools.errors import CacheError, DataError

__all__ = ["FileCache", "SourceChanged", "TMP_PREFIX"]

_log = get_logger("data.cache")

_LOCKS = ".locks"
_SKIP = (
    _LOCKS,
    ".index",
)  # lock files and dataset indexes (see ``_listing._catalog``): never evicted
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_CHUNK = 1 << 20
_SPACE_WAIT_S = 120.0
#: Copies of one file tried before a source that keeps changing is an error.
_COPY_TRIES = 3


class SourceChanged(Exception):
    """A copy does not hold the source as listed: it changed before or while it was read."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(message)
        self.source = source


def source_stat(src: IO[bytes]) -> tuple[int, int] | None:
    """``(size, mtime_ns)`` of an open source, or None where it has no descriptor."""
    try:
        st = os.fstat(src.fileno())
    except (AttributeError, OSError, ValueError):
        return None  # e.g. an fsspec file: only the byte count is checked
    return st.st_size, st.st_mtime_ns


def check_copy(
    src: IO[bytes],
    key: str,
    size: int,
    mtime_ns: int,
    copied: int,
    before: tuple[int, int] | None,
    after: tuple[int, int] | None,
) -> None:
    """Raise :class:`SourceChanged` unless ``copied`` bytes are the whole, unchanged source."""
    name = getattr(src, "name", None) or getattr(src, "path", None)
    source = name if isinstance(name, str) else key
    if copied > size:
        raise SourceChanged(source, f"listed {size} bytes, it holds more now")
    if copied != size:
        raise SourceChanged(source, f"listed {size} bytes, read {copied}")
    if after is None:
        return
    if before != after:
        was = before[0] if before else "?"
        raise SourceChanged(source, f"{was} bytes when opened, {after[0]} after the copy")
    if after[0] != size or (mtime_ns and after[1] != mtime_ns):
        raise SourceChanged(
            source,
            f"listed {size} bytes, mtime {mtime_ns} ns; now {after[0]} bytes, mtime {after[1]} ns",
        )


# Bytes promised to copies in progress in this process, per cache directory, so
# that parallel copy threads do not all see the same free space and overshoot.
_RESERVED: dict[str, int] = {}
_RESERVED_LOCK = threading.Lock()

# Cache directories whose leftover temporary files this process already swept.
_SWEPT: set[str] = set()
#: Opening a cache walks it for leftover temporaries at most this often per node:
#: a walk costs time per cached file, and every eviction sweeps as well.
_SWEEP_EVERY_S = 600.0


@dataclass(frozen=True)
class _Room:
    """Space claimed for one copy: the open temporary file that holds it."""

    fd: int
    tmp: str
    counted: bool  # claimed only in ``_RESERVED`` (no fallocate on this filesystem)


def _no_room(message: str) -> CacheError:
    exc = CacheError(message)
    exc.errno = errno.ENOSPC
    return exc


def _key_digest(key: str) -> str:
    # os.fsencode: file names that are not valid UTF-8 reach here as surrogates.
    return hashlib.sha1(os.fsencode(key)).hexdigest()


class FileCache:
    """Complete local copies of remote files, evicted oldest-download first.

    Opening a cache checks that its directory is private to this user and
    removes the temporary files of copies whose process died.

    Args:
        cache_dir: Directory of the cache (created if needed, mode 0700).
        min_free_bytes: Keep at least this much free on the cache filesystem;
            None reads the environment, else 10 % of the filesystem.

    Raises:
        CacheError: the directory cannot be created, or another user owns it or
            can write to it.
    """

    def __init__(self, cache_dir: str, min_free_bytes: int | None = None) -> None:
        self.dir = os.path.abspath(cache_dir)
        ensure_private_dir(self.dir)
        locks = os.path.join(self.dir, _LOCKS)
        os.makedirs(locks, mode=0o700, exist_ok=True)
        usage = shutil.disk_usage(self.dir)
        if min_free_bytes is None:
            min_free_bytes = min_free_from_env()
        if min_free_bytes is None:
            min_free_bytes = usage.total // 10
        self.min_free = int(min_free_bytes)
        self._total = usage.total
        self.gate = Gate(locks)
        self.known = KnownFiles(self.gate)
        if self.dir not in _SWEPT:
            _SWEPT.add(self.dir)
            if sweep_due(locks, _SWEEP_EVERY_S):
                self.sweep()

    @property
    def capacity(self) -> int:
        """Bytes the cache can hold at most: the filesystem less the free-space floor."""
        return max(0, self._total - self.min_free)

    # --- lookups and copies -------------------------------------------------------

    def path_for(self, key: str) -> str:
        """Final path of ``key`` (``namespace/relative/path``) in the cache."""
        return f"{self.dir}/{key}" if os.sep == "/" else os.path.join(self.dir, *key.split("/"))

    def pin_if_cached(self, key: str, size: int, mtime_ns: int) -> Pin | None:
        """A pin on the complete, up-to-date copy of ``key``, or None on a miss."""
        pin = pin_path(
            self.path_for(key),
            lambda st: st.st_size == size and (not mtime_ns or st.st_mtime_ns == mtime_ns),
        )
        if pin is not None:
            self.known.add(key, size, mtime_ns)
        return pin

    def cached(self, key: str, size: int, mtime_ns: int) -> str | None:
        """The path of the complete, up-to-date copy of ``key``, or None; no pin.

        Only for a caller that holds the gate (:mod:`nbtools.data._cache._gate`). A file
        this process saw complete since the last eviction is not looked at again.
        """
        path = self.path_for(key)
        if self.known.has(key, size, mtime_ns):
            return path
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if st.st_size == size and (not mtime_ns or st.st_mtime_ns == mtime_ns):
            self.known.add(key, size, mtime_ns)
            return path
        return None

    def fetch(
        self,
        key: str,
        size: int,
        mtime_ns: int,
        opener: Callable[[], IO[bytes]],
        cancel: threading.Event,
        *,
        wait_for_space: bool = True,
        on_wait: Callable[[], None] | None = None,
        restat: Callable[[], tuple[int, int] | None] | None = None,
    ) -> Pin | None:
        """Pin the complete copy of ``key``, copying it from ``opener()`` on a miss.

        A copy is kept only when it holds exactly the bytes of the source as
        listed (``size``, ``mtime_ns``) and the source did not change while it
        was read (``rsync``'s check). Otherwise the source is looked at again
        (``restat()``: its current size and mtime) and copied again; nothing
        partial is served.

        Args:
            key: ``namespace/relative/path`` of the file in the cache.
            size: The source's size as listed.
            mtime_ns: The source's mtime as listed (0: not compared).
            opener: Opens the source for reading.
            cancel: Set to give up a copy in progress.
            wait_for_space: False: return None at once when the cache has no
                room for the file now (a copy ahead of the consumer); True
                (default): wait for room, and never return None.
            on_wait: Called each time the copy waits for room (a stream
                releases what it holds ahead then).
            restat: The source's size and mtime now, or None when gone; without
                it a source that changed is not copied again.

        Raises:
            CacheError: the file is larger than the cache can ever hold, or no
                room appeared within two minutes.
            DataError: the source changed during ``_COPY_TRIES`` copies, or once
                without ``restat``; the message names it.
            Cancelled: ``cancel`` was set during the copy.
        """
        for attempt in range(1, _COPY_TRIES + 1):
            try:
                pin = self.pin_if_cached(key, size, mtime_ns)
                if pin is not None:
                    return pin
                lock_path = os.path.join(self.dir, _LOCKS, _key_digest(key))
                lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    # Another worker may have copied it while this one waited.
                    pin = self.pin_if_cached(key, size, mtime_ns)
                    if pin is not None:
                        return pin
                    room = self._make_room(key, size, wait_for_space, cancel, on_wait)
                    if room is None:
                        return None
                    try:
                        pin = self._copy(key, size, mtime_ns, opener, cancel, room)
                        self.known.add(key, size, mtime_ns)
                        return pin
                    finally:
                        if room.counted:
                            with _RESERVED_LOCK:
                                _RESERVED[self.dir] -= size
                finally:
                    os.close(lock_fd)
            except SourceChanged as exc:
                now = restat() if restat is not None else None
                if attempt == _COPY_TRIES or now is None:
                    raise DataError(
                        f"{exc.source} changed while it was copied into the cache ({exc}); "
                        f"it was not served after {attempt} copies. Let whoever writes it "
                        "finish (write elsewhere, then rename onto the name), then iterate again"
                    ) from None
                _log.warning(
                    "%s changed while it was copied (%s); copying it again", exc.source, exc
                )
                size, mtime_ns = now
                if cancel.wait(0.05 * attempt):
                    raise Cancelled(key) from None
        raise AssertionError("unreachable")

    def _copy(
        self,
        key: str,
        size: int,
        mtime_ns: int,
        opener: Callable[[], IO[bytes]],
        cancel: threading.Event,
        room: _Room,
    ) -> Pin:
        path = self.path_for(key)
        tmp = room.tmp
        try:
            with opener() as src, open(room.fd, "wb", closefd=False) as dst:
                before = source_stat(src)
                copied = 0
                # One byte past the listed size tells a source that grew: a file that is
                # still being appended to is never chased, nor written past its room.
                limit = size + 1
                while copied < limit:
                    if cancel.is_set():
                        raise Cancelled(key)
                    chunk = src.read(min(_CHUNK, limit - copied))
                    if not chunk:
                        break
                    dst.write(chunk)
                    copied += len(chunk)
                check_copy(src, key, size, mtime_ns, copied, before, source_stat(src))
                dst.flush()
                os.ftruncate(room.fd, dst.tell())  # the allocation may have been larger
            if mtime_ns:
                os.utime(tmp, ns=(mtime_ns, mtime_ns))
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(room.fd)
        return Pin(path, fd)

    # --- space ----------------------------------------------------------------------

    def _make_room(
        self,
        key: str,
        size: int,
        wait: bool,
        cancel: threading.Event,
        on_wait: Callable[[], None] | None = None,
    ) -> _Room | None:
        if size > self.capacity:
            raise _no_room(
                f"{key} ({size} bytes) is larger than the cache at {self.dir!r} can hold "
                f"({self._total} bytes, of which {self.min_free} are kept free); "
                "use a cache_dir on a larger filesystem or lower min_free_bytes"
            )
        deadline = time.monotonic() + _SPACE_WAIT_S
        delay = 0.01
        looked = False
        while True:
            room = self._reserve(key, size)
            if room is not None:
                return room
            margin = min(max(self._total // 50, size), 1 << 30)
            self.evict(self.min_free + size + margin + _RESERVED.get(self.dir, 0))
            room = self._reserve(key, size)
            if room is not None:
                return room
            if not wait:
                return None
            if cancel.is_set():
                raise Cancelled(key)
            if not looked:
                # Waiting helps only when the cache's own files, once released and
                # evicted, would make room; space that other files hold is said at once.
                looked = True
                self._check_foreign(key, size)
            if time.monotonic() > deadline:
                raise _no_room(
                    f"no room for {key} in the cache at {self.dir!r}: every cached file is in "
                    "use; use fewer workers or a smaller prefetch, or a larger cache filesystem"
                )
            if on_wait is not None:
                on_wait()
            time.sleep(delay)  # files in use by other streams are released as they advance
            delay = min(delay * 2, 0.5)

    def _check_foreign(self, key: str, size: int) -> None:
        """Raise when the copy of ``key`` cannot fit even with every cached file evicted.

        The space then belongs to files that are not the cache's (another
        program's, on the same filesystem), which no wait and no eviction frees.
        """
        usage = shutil.disk_usage(self.dir)
        held = cached_bytes(self.dir, _SKIP)
        needed = size + self.min_free + _RESERVED.get(self.dir, 0)
        if usage.free + held >= needed:
            return
        foreign = max(0, usage.used - held)
        raise _no_room(
            f"no room for {key} ({size} bytes) in the cache at {self.dir!r}: its filesystem has "
            f"{usage.free} bytes free and {needed} are needed (the file, and min_free_bytes="
            f"{self.min_free} kept free); the cache's own files hold {held} bytes there, other "
            f"files {foreign} bytes. Free space on that filesystem, lower the floor "
            f"(min_free_bytes= or ${ENV_MIN_FREE[0]}), or move the cache to a larger "
            f"filesystem (cache_dir= or ${ENV_DIR})"
        )

    def _reserve(self, key: str, size: int) -> _Room | None:
        """Claim ``size`` bytes for a copy of ``key``, or None when that would cut into
        the free-space floor.

        The claim is a temporary file allocated to its full size, made under a
        node-wide lock, so copies in other processes see the space as taken. On
        a filesystem without ``fallocate`` the claim is only counted in this
        process.
        """
        directory = os.path.dirname(self.path_for(key))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        space = os.open(os.path.join(self.dir, _LOCKS, "space"), _LOCK_FLAGS, 0o600)
        try:
            with _RESERVED_LOCK:
                fcntl.flock(space, fcntl.LOCK_EX)
                reserved = _RESERVED.get(self.dir, 0)
                if shutil.disk_usage(self.dir).free - reserved - size < self.min_free:
                    return None
                tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                counted = False
                try:
                    if size:
                        os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        os.close(fd)
                        os.unlink(tmp)
                        if exc.errno == errno.ENOSPC:
                            return None
                        raise
                    counted = True
                    _RESERVED[self.dir] = reserved + size
                return _Room(fd, tmp, counted)
        finally:
            os.close(space)  # drops the lock

    def evict(self, want_free: int) -> int:
        """Delete unpinned files, oldest download first, until ``want_free`` bytes are free.

        Also removes temporary files of processes that no longer exist. Returns
        the number of files deleted. Eviction holds the gate exclusively: while
        another process evicts, or streams still hold the gate (they are asked
        to switch to per-file pins), it returns 0 at once and the caller
        rechecks the free space.
        """
        guard = self.gate.close_for_eviction()
        if guard < 0:
            return 0
        try:
            removed = 0
            for _, path in sorted(scan(self.dir, _SKIP)):
                if shutil.disk_usage(self.dir).free >= want_free:
                    break
                if evict_one(path):
                    removed += 1
            if removed:
                _log.debug("evicted %d files from %s", removed, self.dir)
            return removed
        finally:
            self.gate.reopen(guard)

    def sweep(self) -> int:
        """Remove the temporary files of copies whose process no longer exists.

        Returns how many were removed. Runs when a process first opens the
        cache (at most once every ten minutes per node), and as part of every
        eviction.
        """
        removed = sweep_temporaries(self.dir, _LOCKS)
        if removed:
            _log.debug("removed %d leftover temporary files from %s", removed, self.dir)
        return removed
