"""The copy of a dataset's index kept in the dataset root, shared by every node and job.

With ``index_in_root=True`` the index also lives in ``<root>/.nbtools-index/``
(a hidden directory: listings skip it). A node that finds no fresh index in
its private cache copies that one in (one sequential read instead of listing
every directory of the volume) and uses it only once the copy passed every
check of :func:`~nbtools.data._index.open_index` and the freshness check. A
node that lists the root writes its new index there too (temporary name, then
``os.replace``, so readers on other nodes see a complete file or the previous
one; two nodes writing at once leave one complete index).

An index file there is not trusted blindly: it must be a regular file owned by
this user that nobody else can write to (checked before it is copied), and
the copy must pass the index's own checks (format, pattern, checksums,
every path inside the root). Its paths are relative, so a node that mounts the
volume at another path uses it too. A refused one is rebuilt with a
warning. A root that cannot be written (a read-only mount, another user's
directory) is used as before: each node lists it, with one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import time
import warnings

from nbtools._internal.fs import TMP_PREFIX
from nbtools._internal.log import get_logger

__all__ = ["fetch_shared", "prepare_shared", "publish_shared", "shared_path"]

_log = get_logger("data.catalog")

_DIR = ".nbtools-index"
#: Temporaries older than this in the shared directory belong to a dead writer.
_STALE_TMP_S = 3600.0
_WARNED: set[str] = set()


def shared_path(root: str, pattern: str) -> str:
    """Where the index of ``(root, pattern)`` lives in the root."""
    tag = hashlib.sha1(pattern.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{root}/{_DIR}/index-{tag}.idx"


def _warn(text: str) -> None:
    warnings.warn(text, RuntimeWarning, stacklevel=5)
    _log.warning("%s", text)


def _warn_once(key: str, text: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _warn(text)


def fetch_shared(shared: str, private: str) -> bool:
    """Copy the index at ``shared`` onto ``private``; False when there is none or it is refused.

    The copy still has to pass :func:`~nbtools.data._index.open_index`.
    """
    try:
        fd = os.open(shared, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as exc:
        _warn(f"not using the dataset index {shared}: {exc.strerror or exc}; listing the root")
        return False
    tmp = f"{os.path.dirname(private)}/{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}.idx"
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "it is not a regular file"
        elif st.st_uid != os.getuid():
            why = f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            why = f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})"
        if why is not None:
            _warn(f"not using the dataset index {shared}: {why}; listing the root again")
            return False
        with open(fd, "rb", closefd=False) as src, open(tmp, "xb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.chmod(tmp, 0o600)
        os.replace(tmp, private)
        return True
    except OSError as exc:
        _warn(f"not using the dataset index {shared}: {exc}; listing the root")
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def prepare_shared(shared: str) -> bool:
    """Create the shared directory before a listing; False when the root cannot hold it
    (said once).

    Creating it changes the root's modification time, which would make every
    index of the root (this node's next one, other nodes' and jobs') look
    stale. The root's time is set back to what it was: the listing that
    follows sees whatever else changed meanwhile, and ``.nbtools-index``
    itself is never a sample. Where the time cannot be set (a root owned by
    someone else), the next launch lists once more.
    """
    directory = os.path.dirname(shared)
    root = os.path.dirname(directory)
    try:
        before = os.stat(root)
        os.mkdir(directory, 0o755)
    except FileExistsError:
        return True
    except OSError as exc:
        _warn_once(
            directory,
            f"cannot keep the dataset index in the root ({directory}: {exc.strerror or exc}); "
            "each node lists the root itself. Pass index_in_root=False to silence this",
        )
        return False
    with contextlib.suppress(OSError):
        os.utime(root, ns=(before.st_atime_ns, before.st_mtime_ns))
    return True


def _sweep(directory: str) -> None:
    """Remove temporaries of writers that died (any node: judged by age, not by pid)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(TMP_PREFIX):
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(entry.path)


def publish_shared(private: str, shared: str, sweep: bool = True) -> None:
    """Write the index at ``private`` to ``shared`` (atomically); a failure is said once.

    ``sweep``: first remove temporaries of writers that died (one listing of the
    shared directory). A writer holding the listing lease it took cleanly knows
    that no dead writer came before it, and skips that.
    """
    directory = os.path.dirname(shared)
    tmp = f"{directory}/{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}.idx"
    try:
        if sweep:
            _sweep(directory)
        shutil.copyfile(private, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, shared)
        _log.info("wrote the dataset index to %s", shared)
    except OSError as exc:
        _warn_once(
            directory,
            f"cannot write the dataset index to {shared}: {exc.strerror or exc}; each node "
            "lists the root itself. Pass index_in_root=False to silence this",
        )
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
