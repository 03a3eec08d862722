"""Local staging space: where shards are written before upload and after download.

The base directory is ``NBTOOLS_STAGING_DIR`` or the system temp dir. Each save
or load gets its own subdirectory, removed afterwards, also after a failure.
The ranks of one node that load one checkpoint together share one
(:func:`shared_area`): a record any of them stages is staged once per node,
and one space check, made for the node, covers them (:func:`node_of`,
:func:`space_shortage`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from nbtools._internal import settings
from nbtools._internal.fs import free_bytes
from nbtools._internal.holder import process_started
from nbtools.errors import CheckpointError, StagingSpaceError

__all__ = [
    "staging_base",
    "staging_area",
    "shared_area",
    "node_of",
    "check_space",
    "space_shortage",
    "shared_name",
    "claim",
    "space_error",
    "used_bytes",
    "sweep",
    "progress",
]

# Free space kept in reserve beyond the estimate (filesystem overhead, other users).
_RESERVE_BYTES = 16 << 20
# Transfers below this size never show a progress bar.
_PROGRESS_MIN_BYTES = 256 << 20


def staging_base(staging_dir: str | os.PathLike[str] | None = None) -> str:
    """The directory under which per-save staging directories are created."""
    base = os.fspath(staging_dir) if staging_dir else settings.read("NBTOOLS_STAGING_DIR")
    return base or tempfile.gettempdir()


def check_space(base: str, needed: int, what: str) -> None:
    """Raise :class:`StagingSpaceError` unless ``base`` has room for ``needed`` bytes."""
    error = space_shortage(base, needed, free_bytes(base), what)
    if error is not None:
        raise error


def space_shortage(base: str, needed: int, free: int, what: str) -> StagingSpaceError | None:
    """The error to raise when ``free`` bytes of ``base`` do not hold ``needed`` bytes and
    the reserve kept free beside them, else None."""
    if needed + _RESERVE_BYTES <= free:
        return None
    return StagingSpaceError(
        f"{what} needs about {needed / 2**20:.1f} MiB of local staging space plus a "
        f"reserve of {_RESERVE_BYTES / 2**20:.1f} MiB kept free on that filesystem "
        f"({(needed + _RESERVE_BYTES) / 2**20:.1f} MiB in all), but {base} has "
        f"{free / 2**20:.1f} MiB free; free some space or point NBTOOLS_STAGING_DIR "
        "(or staging_dir=) at a larger local disk"
    )


def node_of(base: str) -> tuple[list[Any], int]:
    """``(which staging disk, free bytes)`` of this process for staging base ``base``.

    Processes with equal first parts stage on the same directory of the same
    filesystem: the host's name and the base's device and inode (two containers
    on one host have their own temp filesystems, so their own devices).
    """
    os.makedirs(base, exist_ok=True)
    st = os.stat(base)
    return [socket.gethostname(), os.path.realpath(base), st.st_dev, st.st_ino], free_bytes(base)


def used_bytes(path: str) -> int:
    """Bytes of the files directly in ``path`` (what a failed write had staged so far)."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _names_no_space(exc: BaseException) -> bool:
    """True when ``exc`` or an error it was raised from or during is out-of-space."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _SPACE_ERRNOS:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def space_error(exc: BaseException, base: str, needed: int, what: str) -> StagingSpaceError | None:
    """The :class:`StagingSpaceError` to raise for a failed write into ``base``, or None.

    A full disk shows as ``ENOSPC``/``EDQUOT``, or, where a library writes through
    its own layers (torch's zip writer), as an unrelated internal error: a failure
    while that filesystem holds less than the bytes still to be written counts too.

    Args:
        exc: The error the write raised.
        base: The staging directory written into.
        needed: Bytes this write needed in ``base`` in all (at least what it had
            staged when it failed).
        what: What was being written, e.g. ``"rank 1 saving /vol/step_2"``.
    """
    free = free_bytes(base)
    if not (_names_no_space(exc) or free < min(needed, _RESERVE_BYTES)):
        return None
    return StagingSpaceError(
        f"staging directory {base} is full: {free / 2**20:.1f} MiB free, about "
        f"{needed / 2**20:.1f} MiB needed there; {what} could not write its shards "
        f"({type(exc).__name__}: {exc}). Free some space there, or point "
        "NBTOOLS_STAGING_DIR (or staging_dir=) at a larger local disk"
    )


_PREFIX = "nbtools-stage-"


def sweep(base: str) -> list[str]:
    """Remove staging directories of processes that died without cleaning up (e.g. SIGKILL).

    Returns the names removed. A base that does not exist holds nothing to sweep.
    """
    try:
        names = os.listdir(base)
    except OSError:  # no such directory, or not one this user may list
        return []
    removed = []
    for name in names:
        pid = name[len(_PREFIX) :].split("-", 1)[0]
        if name.startswith(_PREFIX) and pid.isdigit() and _dead(os.path.join(base, name), int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


def _dead(path: str, pid: int) -> bool:
    """Whether the process that made staging directory ``path`` is gone.

    Its process id names it; a process with that id that started after the
    directory last changed is another one (the id was reused).
    """
    started = process_started(pid)
    if started is None:
        return True
    try:
        changed = os.lstat(path).st_mtime
    except OSError:
        return False  # gone already, or not ours to judge
    return started != -1.0 and started > changed + 1.0


@contextlib.contextmanager
def staging_area(base: str) -> Iterator[str]:
    """A fresh private directory under ``base``, removed on exit whatever happens.

    Directories left by dead processes are removed first.
    """
    os.makedirs(base, exist_ok=True)
    sweep(base)
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def shared_name(leader_pid: int, token: str) -> str:
    """The name of a load's area shared by a node, made by the ranks' coordinator: the
    pid of the node's first rank (so :func:`sweep` removes it once that one is gone)."""
    return f"{_PREFIX}{leader_pid}-{token}"


@contextlib.contextmanager
def shared_area(base: str, name: str) -> Iterator[str]:
    """The directory ``name`` under ``base`` that the ranks of one node load through.

    Every rank enters it (the first creates it) and leaves a mark there while it
    is inside; the last to leave removes it, also after a failure. Directories
    left by dead processes are removed first.
    """
    os.makedirs(base, exist_ok=True)
    sweep(base)
    path = os.path.join(base, name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    _check_ours(path)
    mark = os.path.join(path, f".in-{os.getpid()}")
    with open(mark, "w"):
        pass
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(mark)
        try:
            inside = any(n.startswith(".in-") for n in os.listdir(path))
        except OSError:
            inside = False
        if not inside:
            shutil.rmtree(path, ignore_errors=True)


def _check_ours(path: str) -> None:
    """Refuse a shared staging directory this user does not own alone: its records are read
    back into the checkpoint's tensors."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CheckpointError(
            f"the staging directory {path} is not a directory of this user's alone (owner uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); nothing was read from it. Remove "
            "it, or point NBTOOLS_STAGING_DIR (or staging_dir=) at a directory of your own"
        )


def claim(area: str, key: tuple[str, int, int]) -> bool:
    """Whether this process is the one of its node that writes record ``key`` into the
    shared ``area`` (the first to ask is; every later one reads what it wrote)."""
    claims = os.path.join(area, ".claims")
    os.makedirs(claims, exist_ok=True)
    name, offset, length = key
    mark = os.path.join(claims, f"{name.replace(os.sep, '%')}@{offset}+{length}")
    try:
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, main: bool) -> Any:
    """A byte progress bar on the main rank in an interactive session, else a no-op."""
    interactive = "ipykernel" in sys.modules or sys.stderr.isatty()
    if not (main and interactive and total >= _PROGRESS_MIN_BYTES):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)
