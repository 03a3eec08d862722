"""Atomic files and free-space checks on local filesystems.

A file appears under its final name only once it is complete: it is written to
a temporary name in the same directory and moved with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_write", "free_bytes", "fsync_dir", "pid_alive", "TMP_PREFIX"]

#: Prefix of every temporary file nbtools creates next to a final name (checkpoint
#: shards, data cache copies, metadata): a name with it is never a finished file.
TMP_PREFIX = ".nbtools-tmp-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry to disk (best effort; some filesystems refuse)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "wb", fsync: bool = True
) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path``; on success move it onto ``path``.

    On any exception the temporary file is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(directory)


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes available to this user on the filesystem holding ``path``."""
    path = os.fspath(path)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return shutil.disk_usage(path or ".").free


def pid_alive(pid: int) -> bool:
    """True if a process with this id exists (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
