"""A local sqlite store: opened by one process at a time, and refused at once when it cannot work.

MLflow creates a new sqlite store on first use: it creates the tables and runs
the schema migrations, 1-10 s. Two processes doing that on one new file at the
same time (two kernels, or the ranks of one job) collide: one of them fails
with ``table experiments already exists`` or an alembic error, and whatever it
was to log is lost. :func:`open_store` therefore opens a sqlite store while
holding an exclusive ``fcntl.flock`` on a lock file next to the database,
``<db>.nbtools-lock``. A process that waits for the lock finds the store
complete and merely opens it. Processes that do not go through nbtools are
not serialized (MLflow itself takes no such lock).

A store that cannot work at all (its directory or file is read-only, or the
path cannot be created) makes MLflow retry creating its engine 10 times with
exponential back-off, about 100 s, before it gives up. :func:`open_store`
checks the file first with the standard library's ``sqlite3`` and raises
:class:`~nbtools.errors.TrackingStoreError` (``permanent``) at once. A
database that is merely busy (``database is locked``) is left to MLflow, which
waits for it.

Other stores (a tracking server, a database server, a file store) are opened
as MLflow opens them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

from nbtools.errors import TrackingStoreError

__all__ = ["LOCK_SUFFIX", "creation_lock", "is_permanent", "open_store", "sqlite_path"]

#: Appended to the database's path to name its lock file.
LOCK_SUFFIX = ".nbtools-lock"
# Words of sqlite's own messages for failures that retrying cannot fix.
_PERMANENT_SQLITE = (
    "attempt to write a readonly database",
    "unable to open database file",
    "readonly database",
)
_PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})


def sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:`` tracking URI; None for any other store or memory.

    ``sqlite:///relative.db`` is relative to the working directory, as for MLflow;
    ``sqlite:////abs/path.db`` is absolute. SQLite's own ``file:`` URIs are not
    interpreted (None).
    """
    if not uri.startswith("sqlite:"):
        return None
    parts = urlsplit(uri)
    path = unquote(parts.path)
    if not path.startswith("/") or path in ("/", "/:memory:"):
        return None
    path = path[1:]  # sqlite:///x -> "/x" -> "x" (relative); sqlite:////x -> "//x" -> "/x"
    if not path or path.startswith("file:"):
        return None
    return os.path.abspath(path)


def is_permanent(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) says the store cannot work at all, not that it is busy."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "permanent", False):
            return True
        if isinstance(current, OSError) and current.errno in _PERMANENT_ERRNOS:
            return True
        text = str(getattr(current, "message", current)).lower()
        if any(phrase in text for phrase in _PERMANENT_SQLITE):
            return True
        current = current.__cause__ or current.__context__
    return False


def _refused(uri: str, path: str, reason: str) -> TrackingStoreError:
    return TrackingStoreError(
        f"the MLflow store at {uri} cannot be written ({reason}: {path}); this does not pass "
        "by retrying: make the file and its directory writable, or point MLFLOW_TRACKING_URI "
        "at a writable place (e.g. sqlite:///$HOME/mlflow.db)"
    )


@contextlib.contextmanager
def creation_lock(uri: str, path: str) -> Iterator[None]:
    """Hold the exclusive lock of the sqlite store at ``path`` (created next to it).

    Raises:
        TrackingStoreError: The directory cannot be created or written.
    """
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno in _PERMANENT_ERRNOS or not os.access(directory, os.W_OK):
            raise _refused(uri, path, exc.strerror or str(exc)) from exc
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _check_writable(uri: str, path: str) -> None:
    """Open the database for writing once, as MLflow will; raise when it never can."""
    try:
        connection = sqlite3.connect(path, timeout=1.0)
    except sqlite3.Error as exc:
        raise _refused(uri, path, str(exc)) from exc
    try:
        connection.execute("BEGIN IMMEDIATE")  # takes the write lock: needs write access
        connection.rollback()
    except sqlite3.OperationalError as exc:
        if is_permanent(exc):
            raise _refused(uri, path, str(exc)) from exc
        # "database is locked" and the like: busy, not broken; MLflow waits for it.
    finally:
        connection.close()


def open_store(uri: str) -> Any:
    """An ``mlflow.MlflowClient`` for ``uri`` whose store is open (created first when new).

    Raises:
        TrackingStoreError: A sqlite store that cannot be created or written.
        MlflowException: MLflow could not open the store.
    """
    import mlflow

    path = sqlite_path(uri)
    if path is None:
        return mlflow.MlflowClient(tracking_uri=uri)
    with creation_lock(uri, path):
        _check_writable(uri, path)
        client = mlflow.MlflowClient(tracking_uri=uri)  # opens the store (tables of a new one)
        client.search_experiments(max_results=1)
    return client


def prepare_store(uri: str) -> bool:
    """Create the local sqlite store at ``uri`` if it is new; False when it is no local store.

    Raises:
        TrackingStoreError: It cannot be created or written.
    """
    if sqlite_path(uri) is None:
        return False
    open_store(uri)
    return True
