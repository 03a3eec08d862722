"""Listing and opening the files of a dataset root: a local directory, a mount, or an fsspec URL."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Any

from nbtools._internal.location import local_path
from nbtools.errors import DataError

__all__ = ["FileList", "Opener", "list_files"]


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


@dataclass(frozen=True)
class FileList:
    """The files of one root, sorted by relative path.

    Attributes:
        root: The root as given (path or URL), without a trailing slash.
        relpaths: ``/``-separated paths relative to ``root``.
        sizes: Size in bytes of each file, from the listing.
        mtimes: Modification time of each file (integer nanoseconds, 0 if unknown).
        fingerprint: A digest of the relative paths, to recognise the same dataset.
    """

    root: str
    relpaths: tuple[str, ...]
    sizes: tuple[int, ...]
    mtimes: tuple[int, ...]
    fingerprint: str

    def __len__(self) -> int:
        return len(self.relpaths)

    def source(self, index: int) -> str:
        """The path or URL of file ``index`` on the volume."""
        return f"{self.root}/{self.relpaths[index]}"


def _hidden(relpath: str) -> bool:
    return any(part.startswith(".") for part in relpath.split("/"))


def _walk_local(root: str) -> list[tuple[str, int, int]]:
    """Files under ``root``, following symbolic links to directories.

    Each directory is entered once, identified by ``(device, inode)``: a link
    back up the tree (``a/up -> ..``) or a second name for a directory does
    not list its files again. Real directories are entered before links to
    them, so files keep the names of their real paths where possible.
    """
    found: list[tuple[str, int, int]] = []
    root_st = os.stat(root)
    seen = {(root_st.st_dev, root_st.st_ino)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        keep = []
        # Real directories first, then links, each in name order: deterministic.
        ordered = sorted(dirnames, key=lambda d: (os.path.islink(os.path.join(dirpath, d)), d))
        for name in ordered:
            if name.startswith("."):
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue  # a dangling link or a directory that vanished
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                keep.append(name)
        dirnames[:] = keep
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:
                continue  # vanished or a dangling link: not part of the dataset
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            found.append((rel, st.st_size, st.st_mtime_ns))
    return found


def _walk_fsspec(root: str) -> tuple[str, list[tuple[str, int, int]]]:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(root)
    path = path.rstrip("/")
    if not fs.exists(path):
        raise FileNotFoundError(
            f"dataset root {root!r} does not exist; check the URL and your credentials"
        )
    if not fs.isdir(path):
        raise NotADirectoryError(f"dataset root {root!r} is a file; pass the directory holding it")
    found = []
    for name, info in fs.find(path, detail=True).items():
        if info.get("type", "file") != "file":
            continue
        rel = name[len(path) :].lstrip("/")
        mtime = info.get("mtime") or info.get("LastModified") or 0
        try:
            mtime_ns = int(float(mtime) * 1e9)
        except (TypeError, ValueError):
            mtime_ns = 0
        found.append((rel, int(info.get("size") or 0), mtime_ns))
    return root.rstrip("/"), found


def list_files(root: str, pattern: str) -> FileList:
    """List the files under ``root`` whose relative path matches ``pattern``.

    Hidden files and directories (a path component starting with ``.``) are
    skipped, as ``glob`` does.

    Raises:
        FileNotFoundError: ``root`` does not exist, or no file matches.
        NotADirectoryError: ``root`` is a file.
    """
    path = local_path(root)
    if path is None:
        root, entries = _walk_fsspec(root)
    else:
        root = path
        if not os.path.exists(root):
            raise FileNotFoundError(
                f"dataset root {root!r} does not exist; check the path (is the volume mounted?)"
            )
        if not os.path.isdir(root):
            raise NotADirectoryError(
                f"dataset root {root!r} is a file; pass the directory holding it"
            )
        entries = _walk_local(root)
    regex = _glob_regex(pattern)
    entries = sorted(e for e in entries if not _hidden(e[0]) and regex.match(e[0]))
    if not entries:
        raise FileNotFoundError(
            f"no file under {root!r} matches pattern {pattern!r}; check the pattern "
            "(it is relative to the root, e.g. '**/*.jpg')"
        )
    digest = hashlib.sha1()
    for rel, _, _ in entries:
        digest.update(rel.encode("utf-8", "surrogateescape") + b"\0")
    return FileList(
        root=root,
        relpaths=tuple(e[0] for e in entries),
        sizes=tuple(e[1] for e in entries),
        mtimes=tuple(e[2] for e in entries),
        fingerprint=digest.hexdigest()[:16],
    )


def _open_local(path: str) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"cannot read {path!r} from the dataset volume ({exc.strerror}); "
            "check that it exists and is readable",
        ) from exc


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
