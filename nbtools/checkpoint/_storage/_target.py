"""Where checkpoints live: a local or mounted directory, or an fsspec URL.

:class:`Target` is the one typed surface every storage fills in, the way
fsspec's ``AbstractFileSystem`` is: the writer, reader, discovery, retention
and lease code use only it and never ask which kind of storage they hold.
What differs between storages is stated as capability attributes
(``local_path``, ``remote``) and behind methods (``publish_bytes`` is a rename
on a filesystem and one PUT on an object store; ``foreign`` finds links only
where links exist). fsspec is imported only for URLs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from typing import IO, Any, Protocol, runtime_checkable

from nbtools._internal.fs import atomic_write, fsync_dir
from nbtools._internal.location import (
    local_path,
    nearest_existing,
    unwritable_reason,
    url_protocols,
)
from nbtools.checkpoint._storage._fsspec_compat import cat_range
from nbtools.checkpoint._storage._mounts import is_remote_fs

__all__ = ["Target", "LocalTarget", "FsspecTarget", "open_target", "can_open"]

# Errors of volumes that cannot rename over a file (some FUSE filesystems).
_NO_RENAME = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)


@runtime_checkable
class Target(Protocol):
    """A directory of a checkpoint store; names given to methods are relative to it.

    Attributes:
        url: How the directory is named to users: an absolute path, or the URL.
        local_path: The directory's path on this machine's filesystem, where its
            files can be opened in place; None for object stores.
        remote: Reading in place is slow (network or FUSE mount, object store),
            so readers stage files on local disk first.
    """

    url: str
    local_path: str | None
    remote: bool

    def child(self, name: str) -> Target:
        """The subdirectory ``name`` (it need not exist)."""
        ...

    def exists(self, rel: str = "") -> bool:
        """Whether ``rel`` (or the directory itself) exists."""
        ...

    def isfile(self, rel: str = "") -> bool:
        """Whether ``rel`` (or the directory itself) is a file."""
        ...

    def listdir(self, rel: str = "") -> list[str]:
        """Names in ``rel``; [] when it does not exist."""
        ...

    def makedirs(self, rel: str = "") -> None:
        """Create ``rel`` (or the directory) and its parents where the store has directories."""
        ...

    def size(self, rel: str) -> int:
        """Size of the file ``rel`` in bytes; a symbolic link is an ``OSError``."""
        ...

    def read_bytes(self, rel: str) -> bytes:
        """The whole content of the file ``rel``."""
        ...

    def open_read(self, rel: str) -> IO[bytes]:
        """The file ``rel``, open for binary reading."""
        ...

    def read_range(self, rel: str, start: int, end: int, timeout: float) -> bytes:
        """Bytes ``[start, end)`` of the file ``rel``; fewer where the file ends first.

        A request that can be cancelled (an async object store's) is cancelled after
        ``timeout`` seconds with ``TimeoutError``; a read of a mount cannot be, and
        is watched by the caller instead.
        """
        ...

    def publish_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` so that ``rel`` is either absent/old or complete, never partial."""
        ...

    def same_filesystem(self, local_dir: str) -> bool:
        """Whether a local file in ``local_dir`` can be moved (renamed) into this directory."""
        ...

    def upload(self, local_file: str, rel: str, fsync: bool, move: bool) -> None:
        """Copy (with ``move``, rename) ``local_file`` to ``rel``; ``fsync`` makes it durable."""
        ...

    def download(self, rel: str, local_file: str) -> None:
        """Copy the file ``rel`` to ``local_file``."""
        ...

    def remove_file(self, rel: str) -> None:
        """Delete the file ``rel`` (absent is fine)."""
        ...

    def remove_tree(self, rel: str = "") -> None:
        """Delete ``rel`` (or the directory) with everything below it (absent is fine)."""
        ...

    def sync_dir(self) -> None:
        """Make the directory's entries durable where the store needs it (else nothing)."""
        ...

    def link(self, rel: str) -> str | None:
        """Where the entry ``rel`` points when it is a symbolic link; None otherwise (absent
        included). Stores without links always say None."""
        ...

    def foreign(self, rel: str) -> str | None:
        """Why the entry ``rel`` is not a real directory (a link, a file); None when it is one
        or is absent. Stores without links or files in place of directories say None."""
        ...


# --- local and mounted directories ---------------------------------------------------


class LocalTarget:
    """A directory on a local or mounted filesystem (ext4, NFS, FUSE, ...)."""

    def __init__(self, root: str | os.PathLike[str], *, remote: bool | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.local_path: str | None = self.root
        self.remote = is_remote_fs(self.root) if remote is None else remote

    def _path(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def child(self, name: str) -> LocalTarget:
        # A checkpoint directory sits on its root's filesystem.
        return LocalTarget(self._path(name), remote=self.remote)

    def exists(self, rel: str = "") -> bool:
        return os.path.exists(self._path(rel))

    def isfile(self, rel: str = "") -> bool:
        return os.path.isfile(self._path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return os.listdir(self._path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, rel: str = "") -> None:
        os.makedirs(self._path(rel), exist_ok=True)

    def size(self, rel: str) -> int:
        path = self._path(rel)
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise OSError(
                errno.ELOOP, f"a symbolic link to {os.path.realpath(path)}; not followed", path
            )
        return info.st_size

    def read_bytes(self, rel: str) -> bytes:
        with open(self._path(rel), "rb") as fh:
            return fh.read()

    def open_read(self, rel: str) -> IO[bytes]:
        return open(self._path(rel), "rb")

    def read_range(self, rel: str, start: int, end: int, timeout: float) -> bytes:
        fd = os.open(self._path(rel), os.O_RDONLY)
        try:
            parts, at = [], start
            while at < end:
                data = os.pread(fd, end - at, at)
                if not data:
                    break  # the file ends here
                parts.append(data)
                at += len(data)
            return b"".join(parts)
        finally:
            os.close(fd)

    def publish_bytes(self, rel: str, data: bytes) -> None:
        try:
            with atomic_write(self._path(rel), "wb") as fh:
                fh.write(data)
        except OSError as exc:  # some FUSE volumes cannot rename; write in place then
            if exc.errno not in _NO_RENAME:
                raise
            with open(self._path(rel), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())

    def same_filesystem(self, local_dir: str) -> bool:
        try:
            return os.stat(local_dir).st_dev == os.stat(self.root).st_dev and not self.remote
        except OSError:
            return False

    def upload(self, local_file: str, rel: str, fsync: bool, move: bool) -> None:
        dst = self._path(rel)
        if move:
            os.replace(local_file, dst)
        else:
            shutil.copyfile(local_file, dst)
        if fsync:
            fd = os.open(dst, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def download(self, rel: str, local_file: str) -> None:
        shutil.copyfile(self._path(rel), local_file)

    def remove_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(rel))

    def remove_tree(self, rel: str = "") -> None:
        shutil.rmtree(self._path(rel), ignore_errors=True)

    def sync_dir(self) -> None:
        fsync_dir(self.root)

    def link(self, rel: str) -> str | None:
        path = self._path(rel)
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                return None
        except FileNotFoundError:
            return None
        return os.path.realpath(path)

    def foreign(self, rel: str) -> str | None:
        try:
            mode = os.lstat(self._path(rel)).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(mode):
            return None
        dest = self.link(rel)
        return f"a symbolic link to {dest}" if dest is not None else "not a directory"


# --- object stores and other fsspec filesystems ------------------------------------------


class FsspecTarget:
    """A prefix in an fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...)."""

    local_path: str | None = None
    remote = True

    def __init__(self, url: str, fs: Any = None, root: str | None = None) -> None:
        if fs is None:
            import fsspec

            fs, root = fsspec.core.url_to_fs(url)
        self.fs = fs
        self.root = (root or "").rstrip("/")
        self.url = url.rstrip("/")

    def _path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def child(self, name: str) -> FsspecTarget:
        return FsspecTarget(f"{self.url}/{name}", self.fs, self._path(name))

    def exists(self, rel: str = "") -> bool:
        return self.fs.exists(self._path(rel))

    def isfile(self, rel: str = "") -> bool:
        return self.fs.isfile(self._path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        # Always a fresh listing: a cached one misses what other processes wrote since
        # (another save's marker, files of a save that just published).
        self.fs.invalidate_cache(self._path(rel))
        try:
            entries = self.fs.ls(self._path(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def makedirs(self, rel: str = "") -> None:
        self.fs.makedirs(self._path(rel), exist_ok=True)

    def size(self, rel: str) -> int:
        return int(self.fs.size(self._path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._path(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self._path(rel), "rb")

    def read_range(self, rel: str, start: int, end: int, timeout: float) -> bytes:
        return cat_range(self.fs, self._path(rel), start, end, timeout)

    def publish_bytes(self, rel: str, data: bytes) -> None:
        # One PUT: object stores make an object visible only once it is complete.
        self.fs.pipe_file(self._path(rel), data)

    def same_filesystem(self, local_dir: str) -> bool:
        return False

    def upload(self, local_file: str, rel: str, fsync: bool, move: bool) -> None:
        self.fs.put_file(local_file, self._path(rel))

    def download(self, rel: str, local_file: str) -> None:
        self.fs.get_file(self._path(rel), local_file)

    def remove_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(rel))

    def remove_tree(self, rel: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(rel), recursive=True)

    def sync_dir(self) -> None:
        pass  # an object is durable once its PUT returns

    def link(self, rel: str) -> str | None:
        return None  # object stores hold no links

    def foreign(self, rel: str) -> str | None:
        return None  # and a prefix is a directory


# --- opening ----------------------------------------------------------------------------


def _protocol_installed(protocol: str) -> bool:
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):
        return False
    return True


def can_open(checkpoint_id: Any, write: bool) -> bool:
    """True when a checkpoint directory at ``checkpoint_id`` can be opened here.

    A plain or ``file://`` path: it (or, when it does not exist yet, the nearest
    existing ancestor) is a directory with the needed permissions. Any other URL,
    chained ones (``simplecache::s3://...``) included: every protocol in it is one
    fsspec knows and whose implementation is installed.

    Args:
        checkpoint_id: The path or URL.
        write: Whether a checkpoint is to be written there (else read).
    """
    try:
        text = os.fspath(checkpoint_id)
    except TypeError:
        return False
    if not isinstance(text, str) or not text:
        return False
    path = local_path(text)
    if path is None:
        protocols = url_protocols(text)
        return all(p and _protocol_installed(p) for p in protocols)
    if write:
        return unwritable_reason(path) is None
    if os.path.isdir(path):
        return os.access(path, os.R_OK | os.X_OK)
    probe = nearest_existing(path)
    return probe is not None and os.path.isdir(probe) and os.access(probe, os.X_OK)


def open_target(location: str | os.PathLike[str] | Target) -> Target:
    """The :class:`Target` for a path, a ``file://`` URL or an fsspec URL (a target as is)."""
    if isinstance(location, (str, os.PathLike)):
        text = os.fspath(location)
        if isinstance(text, str):
            path = local_path(text)
            return FsspecTarget(text) if path is None else LocalTarget(path)
    elif isinstance(location, Target):
        return location
    raise TypeError(
        f"checkpoint path must be a str or os.PathLike[str], not {type(location).__name__}"
    )
