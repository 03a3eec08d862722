"""Listing and opening the files of a dataset root: a local directory, a mount, or an fsspec URL."""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from functools import lru_cache
from typing import IO, Any

from nbtools import runtime
from nbtools._internal.location import local_path
from nbtools._internal.log import get_logger
from nbtools.errors import DataError

__all__ = ["Opener", "Progress", "check_root", "list_dir", "walk_fsspec", "walk_local"]

_log = get_logger("data.listing")


@lru_cache(maxsize=32)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a glob with ``**`` into a regex on ``/``-separated relative paths."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _hidden(relpath: str) -> bool:
    return any(part.startswith(".") for part in relpath.split("/"))


class Progress:
    """Logs how far a long listing has got, every ``every_s`` seconds (rank 0 only)."""

    def __init__(self, root: str, every_s: float = 5.0) -> None:
        self.root = root
        self.every_s = every_s
        self.files = 0
        self.dirs = 0
        self._start = time.monotonic()
        self._next = self._start + every_s
        self._loud = runtime.get_rank() == 0

    def tick(self, files: int, dirs: int) -> None:
        self.files, self.dirs = files, dirs
        now = time.monotonic()
        if self._loud and now >= self._next:
            self._next = now + self.every_s
            _log.info(
                "listing %s: %d files in %d directories so far (%.0f s)",
                self.root,
                files,
                dirs,
                now - self._start,
            )


def _scan_dir(path: str) -> list[tuple[str, os.DirEntry[str], bool]]:
    """The entries of one directory, not hidden, in the order that keeps paths sorted.

    Sorting each directory by ``name + "/"`` for directories and ``name`` for
    files makes a depth-first walk yield relative paths in plain string order.
    """
    out = []
    with os.scandir(path) as it:
        for entry in it:
            name = entry.name
            if name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            out.append((name + "/" if is_dir else name, entry, is_dir))
    out.sort(key=lambda e: e[0])
    return out


def _matcher(pattern: str) -> Callable[[str], Any] | None:
    """The regex match of ``pattern``, or None when it matches every path (``**/*``)."""
    return None if pattern in ("**/*", "**") else _glob_regex(pattern).match


def list_dir(
    root: str, rel_dir: str, pattern: str
) -> tuple[list[tuple[bytes, int, int]], list[str]]:
    """One directory as :func:`walk_local` lists it: its files and the subdirectories it enters.

    Returns ``(name, size, mtime_ns)`` of the files matching ``pattern``
    directly in ``rel_dir`` (in listing order), and the relative paths of the
    subdirectories a walk would enter from it (links into the root excluded).

    Raises:
        OSError: the directory cannot be read.
    """
    match = _matcher(pattern)
    real_root = os.path.realpath(root)
    prefix = f"{rel_dir}/" if rel_dir else ""
    files: list[tuple[bytes, int, int]] = []
    dirs: list[str] = []
    for _, entry, is_dir in _scan_dir(f"{root}/{rel_dir}" if rel_dir else root):
        rel = prefix + entry.name
        try:
            st = entry.stat()
        except OSError:
            continue
        if not is_dir:
            if match is None or match(rel):
                files.append(
                    (entry.name.encode("utf-8", "surrogateescape"), st.st_size, st.st_mtime_ns)
                )
        elif entry.is_symlink() and _inside(entry.path, real_root):
            continue
        else:
            dirs.append(rel)
    return files, dirs


def _inside(link: str, real_root: str) -> bool:
    """True for a link to a directory inside the root (listed under its real name)."""
    inside = os.path.relpath(os.path.realpath(link), real_root)
    return inside == "." or (not inside.startswith("..") and not _hidden(inside))


def walk_local(root: str, pattern: str, writer: Any, progress: Progress | None = None) -> int:
    """List ``root`` into ``writer`` (``add_files``/``add_dir``), depth first, paths sorted.

    Symbolic links are followed; each directory is entered once, identified by
    ``(device, inode)``, so a link back up the tree lists nothing twice. A link
    to a directory inside the root is skipped: its files keep their real
    names. Memory stays bounded by the largest directory, whatever the total.
    Returns the number of directories listed.
    """
    match = _matcher(pattern)
    real_root = os.path.realpath(root)
    root_st = os.stat(root)
    seen = {(root_st.st_dev, root_st.st_ino)}
    writer.add_dir(b"", root_st.st_mtime_ns)
    stack = [("", iter(_scan_dir(root)))]
    listed, files = 1, 0
    while stack:
        rel_dir, entries = stack[-1]
        prefix = f"{rel_dir}/" if rel_dir else ""
        rels: list[bytes] = []
        sizes: list[int] = []
        mtimes: list[int] = []
        child = None
        for _, entry, is_dir in entries:
            rel = prefix + entry.name
            try:
                st = entry.stat()
            except OSError:
                continue  # vanished, or a dangling link: not part of the dataset
            if not is_dir:
                if match is None or match(rel):
                    rels.append(rel.encode("utf-8", "surrogateescape"))
                    sizes.append(st.st_size)
                    mtimes.append(st.st_mtime_ns)
                continue
            if entry.is_symlink() and _inside(entry.path, real_root):
                continue  # listed under its real name
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            try:
                children = _scan_dir(entry.path)
            except OSError:
                continue  # unreadable or vanished meanwhile
            writer.add_dir(rel.encode("utf-8", "surrogateescape"), st.st_mtime_ns)
            listed += 1
            child = (rel, iter(children))
            break
        if rels:
            writer.add_files(rels, sizes, mtimes)
            files += len(rels)
        if child is None:
            stack.pop()
        else:
            stack.append(child)
            if progress is not None and listed % 64 == 0:
                progress.tick(files, listed)
    return listed


def walk_fsspec(root: str, pattern: str, writer: Any) -> None:
    """List the fsspec URL ``root`` into ``writer`` (sorted; no directory mtimes)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(root)
    path = path.rstrip("/")
    if not fs.exists(path):
        raise FileNotFoundError(
            f"dataset root {root!r} does not exist; check the URL and your credentials"
        )
    if not fs.isdir(path):
        raise NotADirectoryError(f"dataset root {root!r} is a file; pass the directory holding it")
    regex = _glob_regex(pattern)
    found = []
    for name, info in fs.find(path, detail=True).items():
        if info.get("type", "file") != "file":
            continue
        rel = name[len(path) :].lstrip("/")
        if _hidden(rel) or not regex.match(rel):
            continue
        mtime = info.get("mtime") or info.get("LastModified") or 0
        if hasattr(mtime, "timestamp"):
            mtime = mtime.timestamp()
        try:
            mtime_ns = int(float(mtime) * 1e9)
        except (TypeError, ValueError):
            mtime_ns = 0
        found.append((rel, int(info.get("size") or 0), mtime_ns))
    found.sort()
    for start in range(0, len(found), 4096):
        chunk = found[start : start + 4096]
        writer.add_files(
            [os.fsencode(e[0]) for e in chunk], [e[1] for e in chunk], [e[2] for e in chunk]
        )


def check_root(root: str) -> str:
    """``root`` as a local path (checked to be a directory), or the URL unchanged.

    Raises:
        FileNotFoundError: a local ``root`` does not exist.
        NotADirectoryError: it is a file.
    """
    path = local_path(root)
    if path is None:
        return root.rstrip("/")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"dataset root {path!r} does not exist; check the path (is the volume mounted?)"
        )
    if not os.path.isdir(path):
        raise NotADirectoryError(f"dataset root {path!r} is a file; pass the directory holding it")
    return path.rstrip("/") or "/"


def _open_local(path: str) -> IO[bytes]:
    """``path`` opened for reading, if it is a regular file.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read: a
    FIFO, socket or device put on the shared volume in place of a file is
    refused at once instead of blocking the copy for good.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"cannot read {path!r} from the dataset volume ({exc.strerror}); "
            "check that it exists and is readable",
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(
                f"cannot read {path!r} from the dataset volume: it is {_kind(st.st_mode)}, "
                "not a regular file; remove it from the dataset root or narrow the pattern"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"a special file (mode {mode:o})"


class Opener:
    """Opens one source file; picklable, so items can be built in any process."""

    __slots__ = ("source", "fs")

    def __init__(self, source: str, fs: Any = None) -> None:
        self.source = source
        self.fs = fs

    def __call__(self) -> IO[bytes]:
        if self.fs is None:
            return _open_local(self.source)
        try:
            return self.fs.open(self.source, "rb")
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot read {self.source!r}: {exc}") from exc
        except Exception as exc:
            raise DataError(f"cannot read {self.source!r}: {exc}") from exc
