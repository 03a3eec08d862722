"""One index per dataset and node: built by one process, checked and reused by the others.

The index of ``(root, pattern)`` lives in the private cache directory, under
``.index/``. A process that needs it:

1. maps the index there, if any, and uses it when it passes every check of
   :func:`~nbtools.data._index.open_index` and is *fresh*;
2. otherwise takes the index's lock (``flock`` in ``.locks/``), looks again
   (another process may have built it meanwhile), and only then lists the root
   and writes a new index (temporary name, then ``os.replace``).

So on a node one process lists, and every other rank and worker waits for it
and maps the same file. The first process to open a version of the index
reads all of it (checksums, paths) and notes its identity next to it
(``.checked``); the others check its header only, so opening a large index
costs no time per file. An index that fails a check (damaged, another user's,
another version, a path outside the root) is rebuilt, with a warning.

Fresh means: every directory the listing entered still has the modification
time it had then (one ``stat`` per directory, no listing). That sees files
added, removed or renamed onto a name in any listed directory, and
directories added or removed. It cannot see a file rewritten in place (the
directory does not change; each file's own size and mtime are compared when
it is served, so its copy is made again), nor anything on a mount whose
directory mtimes do not change (some FUSE and object-store mounts): use
``refresh=True`` there. A directory modified within ``_RACY_NS`` before it was
listed could have changed unseen in the same clock tick: such a directory (and
only it) is listed again and compared with the index before the index is
reused (see :func:`_fresh`). An fsspec URL has no directory times: it is listed once per job.
``refresh=True`` lists again once per job (the index records which job built it).

With ``index_in_root=True`` the index is also kept in the dataset root, where
other nodes and later jobs find it (see ``_shared_index``): a node without a fresh
private index copies that one in, checks it, and lists the root only when it
is missing, refused or stale, and only while it holds the listing lease (see
``_lease``): nodes that start at the same moment wait for the one that
lists. An index written by a node of the same job is used without the
freshness check, as one of this node's own would be.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import warnings

from nbtools._internal.fs import TMP_PREFIX
from nbtools._internal.log import get_logger
from nbtools.data._cache import ENV_DIR, ensure_private_dir
from nbtools.data._listing._index import Index, IndexRefused, IndexWriter, open_index
from nbtools.data._listing._lease import lead_or_wait
from nbtools.data._listing._shared_index import (
    fetch_shared,
    prepare_shared,
    publish_shared,
    shared_path,
)
from nbtools.data._listing._volume import Progress, check_root, list_dir, walk_fsspec, walk_local
from nbtools.errors import CacheError

__all__ = ["index_path", "job_token", "load_index", "namespace"]

_log = get_logger("data.catalog")

_DIR = ".index"
_CHECKED = ".checked"
_SETTLED = ".settled"
_RACY_NS = 2_000_000_000
_JOB_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")


def namespace(root: str) -> str:
    """The cache's directory name for the files of ``root``."""
    digest = hashlib.sha1(root.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    name = os.path.basename(root.rstrip("/")) or "root"
    return f"{name}-{digest}"


def index_path(cache_dir: str, root: str, pattern: str) -> str:
    """Where the index of ``(root, pattern)`` lives in ``cache_dir``."""
    tag = hashlib.sha1(pattern.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return os.path.join(cache_dir, _DIR, f"{namespace(root)}-{tag}.idx")


def job_token(fallback: str) -> str:
    """What identifies this launch: its elastic run and restart, else ``fallback``."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT"):
        return "|".join(os.environ.get(v, "") for v in _JOB_VARS)
    return fallback


def _fresh(index: Index) -> str | None:
    """None when no listed directory changed since the listing; else what changed.

    A directory modified within ``_RACY_NS`` before it was listed (or before
    its last re-check) may have changed again in the same clock tick, which
    its time would not show: those directories alone are listed again and
    compared with the index. When they match, the time of that re-check is
    noted next to the index (``.settled``), so a later launch re-checks only
    what is still that recent.
    """
    if not index.header.get("checkable"):
        return "the root has no directory times to check"
    started = time.time_ns()
    racy_after = max(int(index.header.get("listed_at_ns", 0)), _settled(index)) - _RACY_NS
    root = index.root
    known: set[str] = set()
    racy: list[str] = []
    for rel, mtime in index.directories():
        path = f"{root}/{rel}" if rel else root
        try:
            st = os.stat(path)
        except OSError:
            return f"directory {path!r} is gone"
        if st.st_mtime_ns != mtime:
            return f"directory {path!r} changed"
        known.add(rel)
        if mtime >= racy_after:
            racy.append(rel)
    for rel in racy:
        why = _recheck(index, rel, known)
        if why is not None:
            return why
    if racy:
        _note_settled(index, started)
    return None


def _recheck(index: Index, rel: str, known: set[str]) -> str | None:
    """None when directory ``rel`` holds what the index lists there; else what differs."""
    path = f"{index.root}/{rel}" if rel else index.root
    listed = index.files_in(rel)
    if listed is None:
        return f"directory {path!r} changed just before it was listed"
    try:
        files, dirs = list_dir(index.root, rel, str(index.header.get("pattern")))
    except OSError:
        return f"directory {path!r} cannot be read"
    if files != listed:
        return f"directory {path!r} changed in the second it was listed"
    if any(d not in known for d in dirs):
        return f"directory {path!r} has a new subdirectory"
    return None


def _settled(index: Index) -> int:
    """When the recent directories of this version of the index were last re-checked (ns)."""
    try:
        with open(index.path + _SETTLED, encoding="ascii") as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return 0
    if not isinstance(value, dict) or value.get("identity") != index.identity:
        return 0
    at = value.get("at_ns")
    return at if isinstance(at, int) else 0


def _note_settled(index: Index, at_ns: int) -> None:
    _write_note(index.path + _SETTLED, {"identity": index.identity, "at_ns": at_ns})


def _checked(path: str) -> list[int] | None:
    """The identity of the version of the index at ``path`` whose bytes were all checked."""
    try:
        with open(path + _CHECKED, encoding="ascii") as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, list) and all(isinstance(v, int) for v in value) else None


def _note_checked(index: Index) -> None:
    """Remember that every byte of this version of the index passed its checks.

    Not for a file changed within the last ``_RACY_NS``: a change in the same
    clock tick would keep its identity.
    """
    if time.time_ns() - index.identity[-1] < _RACY_NS:
        return
    _write_note(index.path + _CHECKED, index.identity)


def _write_note(path: str, value: object) -> None:
    """Write a small JSON note next to an index, whole or not at all (a failure is harmless)."""
    tmp = f"{path}.{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        with open(tmp, "w", encoding="ascii") as fh:
            json.dump(value, fh)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _try_open(path: str, root: str, pattern: str, shown: str | None = None) -> Index | None:
    """The index at ``path`` if it passes its checks; a refusal is warned about as ``shown``.

    Only the first process to open a version of the file reads all of it: the
    others on the node find its identity noted next to it (``.checked``, in the
    private cache) and check the header only.
    """
    try:
        checked = _checked(path)
        index = open_index(path, root, pattern, checked)
        if index.identity != checked:
            _note_checked(index)
        return index
    except FileNotFoundError:
        return None
    except (IndexRefused, OSError) as exc:
        text = f"not using the dataset index {shown or path}: {exc}; listing {root} again"
        warnings.warn(text, RuntimeWarning, stacklevel=4)
        _log.warning("%s", text)
        return None


def _usable(index: Index | None, refresh: bool, token: str) -> bool:
    if index is None:
        return False
    if index.header.get("job") == token:
        return True  # listed by this very job, possibly with refresh=True
    if refresh:
        return False
    why = _fresh(index)
    if why is not None:
        _log.info("listing %s again: %s", index.root, why)
    return why is None


class _RootCopy:
    """Looks at the index kept in the root; copies it in only when it is a version not yet tried."""

    def __init__(
        self, shared: str, path: str, root: str, pattern: str, refresh: bool, token: str
    ) -> None:
        self.shared, self.path, self.root, self.pattern = shared, path, root, pattern
        self.refresh, self.token = refresh, token
        self._tried: tuple[int, int, int] | None = None

    def __call__(self) -> Index | None:
        try:
            st = os.stat(self.shared)
        except OSError:
            return None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        if version == self._tried:
            return None
        self._tried = version
        if not fetch_shared(self.shared, self.path):
            return None
        fetched = _try_open(self.path, self.root, self.pattern, shown=self.shared)
        if not _usable(fetched, self.refresh, self.token):
            return None
        _log.info("using the dataset index %s", self.shared)
        return fetched


def _build(path: str, root: str, pattern: str, token: str, url: bool, progress: Progress) -> None:
    listed_at = time.time_ns()
    listed = False
    writer = IndexWriter(
        path,
        root,
        pattern,
        {
            "job": token,
            "listed_at_ns": listed_at,
            "checkable": not url,
            "listed_by": f"{socket.gethostname()} pid {os.getpid()}",
        },
    )
    try:
        if url:
            walk_fsspec(root, pattern, writer)
            dirs = 0
        else:
            dirs = walk_local(root, pattern, writer, progress)
        if not writer.count:
            raise FileNotFoundError(
                f"no file under {root!r} matches pattern {pattern!r}; check the pattern "
                "(it is relative to the root, e.g. '**/*.jpg')"
            )
        _log.info("listed %s: %d files in %d directories", root, writer.count, dirs)
        listed = True
        writer.commit()
    except OSError as exc:
        writer.discard()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space_for_index(path, root, writer.nbytes, listed) from exc
        raise
    except BaseException:
        writer.discard()
        raise


def _no_space_for_index(path: str, root: str, nbytes: int, listed: bool) -> CacheError:
    """The error of an index that did not fit: where, how much it needs, what to change.

    The writer keeps its sections in spill files until the index is complete
    and then copies them into one file, so the filesystem holds the index
    twice for a moment.
    """
    where = os.path.dirname(path)
    try:
        free = f"{shutil.disk_usage(where).free} bytes are free"
    except OSError:
        free = "its free space is unknown"
    need = (
        f"about {2 * nbytes}" if listed else f"more than {2 * nbytes} (the listing had not ended)"
    )
    exc = CacheError(
        f"cannot write the dataset index of {root!r} in {where!r}: no space left on that "
        f"filesystem; the index needs {need} bytes while it is written and {free}. Free "
        f"space there, or move the cache to a larger filesystem with cache_dir= or "
        f"${ENV_DIR}; nothing was left behind, and the next try lists again"
    )
    exc.errno = errno.ENOSPC
    return exc


@contextlib.contextmanager
def _locked(cache_dir: str, path: str):
    locks = os.path.join(cache_dir, ".locks")
    os.makedirs(locks, mode=0o700, exist_ok=True)
    name = "index-" + hashlib.sha1(os.fsencode(path)).hexdigest()[:16]
    fd = os.open(os.path.join(locks, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load_index(
    root: str, pattern: str, cache_dir: str, refresh: bool, token: str, in_root: bool = False
) -> Index:
    """The checked, fresh index of ``root`` and ``pattern``, listing the root only if needed.

    ``in_root``: also look for the index in the root, and write it there after
    a listing (see ``_shared_index``).

    Raises:
        FileNotFoundError: the root does not exist, or no file matches.
        NotADirectoryError: the root is a file.
        ValueError: ``in_root`` for an fsspec URL.
    """
    root = check_root(root)
    url = not root.startswith("/")
    if in_root and url:
        raise ValueError(
            f"index_in_root=True needs a local directory or a mounted volume, not {root!r}; "
            "pass index_in_root=False"
        )
    cache_dir = os.path.abspath(cache_dir)
    ensure_private_dir(cache_dir)
    os.makedirs(os.path.join(cache_dir, _DIR), mode=0o700, exist_ok=True)
    path = index_path(cache_dir, root, pattern)
    index = _try_open(path, root, pattern)
    if _usable(index, refresh, token):
        return index  # type: ignore[return-value]
    shared = shared_path(root, pattern) if in_root else None
    with _locked(cache_dir, path):
        again = _try_open(path, root, pattern)
        if _usable(again, refresh, token):
            return again  # type: ignore[return-value]
        lease, progress = None, Progress(root)
        if shared is not None:
            look = _RootCopy(shared, path, root, pattern, refresh, token)
            found = look()
            if found is not None:
                return found
            if not prepare_shared(shared):
                shared = None
            else:  # one node lists for all that start now; the others wait for its index
                lease, found = lead_or_wait(shared, token, root, look, progress)
                if found is not None:
                    return found
        try:
            _build(path, root, pattern, token, url, progress)
            if shared is not None:
                clean = lease is not None and lease.held and not lease.took_over
                publish_shared(path, shared, sweep=not clean)
        finally:
            if lease is not None:
                lease.release()
    built = open_index(path, root, pattern)
    _note_checked(built)
    return built
