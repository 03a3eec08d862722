"""Where checkpoints live: a local or mounted directory, or an fsspec URL.

One small interface over both, so the writer, reader, discovery and retention
code never branch on the kind of storage. fsspec is imported only for URLs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import IO, Any

from nbtools._internal.fs import TMP_PREFIX, atomic_write, fsync_dir

__all__ = ["Target", "LocalTarget", "FsspecTarget", "open_target", "is_url", "can_open"]

# Filesystems where reading in place is slow or remote: reads are staged locally.
_REMOTE_FSTYPES = ("nfs", "cifs", "smb", "fuse", "9p", "ceph", "lustre", "gpfs", "glusterfs", "afs")


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` strings (fsspec URLs)."""
    return "://" in os.fspath(path)


def _fstype(path: str) -> str:
    """The mount type of the filesystem holding ``path`` ("" when unknown)."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and (
                    path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")
                ):
                    if len(parts[1]) >= len(best):
                        best, fstype = parts[1], parts[2]
    except OSError:
        return ""
    return fstype


class Target:
    """A directory of a checkpoint store; paths given to methods are relative to it."""

    url: str
    remote: bool

    def child(self, name: str) -> Target:  # pragma: no cover - interface
        raise NotImplementedError

    def exists(self, rel: str = "") -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class LocalTarget(Target):
    """A directory on a local or mounted filesystem (ext4, NFS, FUSE, ...)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.remote = any(self._fstype().startswith(t) for t in _REMOTE_FSTYPES)

    def _fstype(self) -> str:
        path = self.root
        while path and not os.path.exists(path):
            path = os.path.dirname(path)
        return _fstype(os.path.realpath(path or "/"))

    def path(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def child(self, name: str) -> LocalTarget:
        return LocalTarget(self.path(name))

    def exists(self, rel: str = "") -> bool:
        return os.path.exists(self.path(rel))

    def isfile(self, rel: str = "") -> bool:
        return os.path.isfile(self.path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return os.listdir(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, rel: str = "") -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def size(self, rel: str) -> int:
        return os.stat(self.path(rel)).st_size

    def read_bytes(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as fh:
            return fh.read()

    def open_read(self, rel: str) -> IO[bytes]:
        return open(self.path(rel), "rb")

    def publish_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` so that ``rel`` is either absent or complete."""
        try:
            with atomic_write(self.path(rel), "wb") as fh:
                fh.write(data)
        except OSError as exc:  # some FUSE volumes cannot rename; write in place then
            if exc.errno not in (18, 38, 95, 1):  # EXDEV, ENOSYS, EOPNOTSUPP, EPERM
                raise
            with open(self.path(rel), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())

    def same_filesystem(self, local_dir: str) -> bool:
        try:
            return os.stat(local_dir).st_dev == os.stat(self.root).st_dev and not self.remote
        except OSError:
            return False

    def upload(self, local_file: str, rel: str, fsync: bool, move: bool) -> None:
        """Copy (or, on the same filesystem, move) ``local_file`` to ``rel``."""
        dst = self.path(rel)
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
        shutil.copyfile(self.path(rel), local_file)

    def remove_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(rel))

    def remove_tree(self, rel: str = "") -> None:
        shutil.rmtree(self.path(rel), ignore_errors=True)

    def remove_stale_temps(self, rel: str = "") -> None:
        for name in self.listdir(rel):
            if name.startswith(TMP_PREFIX):
                self.remove_file(os.path.join(rel, name) if rel else name)

    def sync_dir(self) -> None:
        fsync_dir(self.root)


class FsspecTarget(Target):
    """A prefix in an fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...)."""

    remote = True

    def __init__(self, url: str, fs: Any = None, root: str | None = None) -> None:
        if fs is None:
            import fsspec

            fs, root = fsspec.core.url_to_fs(url)
        self.fs = fs
        self.root = (root or "").rstrip("/")
        self.url = url.rstrip("/")

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def child(self, name: str) -> FsspecTarget:
        return FsspecTarget(f"{self.url}/{name}", self.fs, self.path(name))

    def exists(self, rel: str = "") -> bool:
        return self.fs.exists(self.path(rel))

    def isfile(self, rel: str = "") -> bool:
        return self.fs.isfile(self.path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def makedirs(self, rel: str = "") -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self.path(rel), "rb")

    def publish_bytes(self, rel: str, data: bytes) -> None:
        # One PUT: object stores make an object visible only once it is complete.
        self.fs.pipe_file(self.path(rel), data)

    def same_filesystem(self, local_dir: str) -> bool:
        return False

    def upload(self, local_file: str, rel: str, fsync: bool, move: bool) -> None:
        self.fs.put_file(local_file, self.path(rel))

    def download(self, rel: str, local_file: str) -> None:
        self.fs.get_file(self.path(rel), local_file)

    def remove_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))

    def remove_tree(self, rel: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)

    def remove_stale_temps(self, rel: str = "") -> None:
        pass

    def sync_dir(self) -> None:
        pass


def _local_can_open(path: str, write: bool) -> bool:
    """The directory ``path``, or the nearest existing ancestor it would be created in,
    is a directory this process may search (and, for ``write``, write)."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    if not os.path.isdir(probe):
        return False  # a file, or a path below a file
    if probe == path and not write:
        return os.access(probe, os.R_OK | os.X_OK)
    return os.access(probe, (os.W_OK | os.X_OK) if write else os.X_OK)


def _protocol_installed(protocol: str) -> bool:
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):
        return False
    return True


def can_open(checkpoint_id: str | os.PathLike[str], write: bool) -> bool:
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
    if text.startswith("file://"):
        return _local_can_open(text[len("file://") :], write)
    if not is_url(text) and "::" not in text:
        return _local_can_open(text, write)
    for part in text.split("::"):
        protocol = part.split("://", 1)[0] if "://" in part else part
        if not protocol or not _protocol_installed(protocol):
            return False
    return True


def open_target(path: str | os.PathLike[str]) -> LocalTarget | FsspecTarget:
    """A :class:`LocalTarget` for paths and ``file://`` URLs, else an :class:`FsspecTarget`."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"checkpoint path must be a str or os.PathLike, not {type(path).__name__}")
    if text.startswith("file://"):
        return LocalTarget(text[len("file://") :])
    if is_url(text):
        return FsspecTarget(text)
    return LocalTarget(text)
