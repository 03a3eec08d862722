"""Checks of where training writes: the data cache, checkpoint staging, the MLflow store.

Every check here looks without leaving anything behind: a directory is tried by creating
and removing one temporary file in it (or in its nearest existing parent, when it does not
exist yet), and the MLflow store is never opened, so no database appears anywhere.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from nbtools._doctor._report import Finding, Status
from nbtools._internal import settings

__all__ = [
    "STAGING_FLOOR_BYTES",
    "cache_location",
    "check_cache",
    "check_mlflow",
    "check_staging",
    "staging_location",
    "try_write",
]

#: Staging holds a rank's shards of one save or load; less than this fails most real models.
STAGING_FLOOR_BYTES = 1 << 30


def cache_location() -> str:
    """Where :class:`~nbtools.data.VolumeDataset` keeps its copies by default (not created)."""
    explicit = settings.read("NBTOOLS_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "nbtools")
    return os.path.join(os.path.expanduser("~"), ".cache", "nbtools")


def staging_location() -> str:
    """Where checkpoint saves and loads stage their shards (``NBTOOLS_STAGING_DIR`` or temp)."""
    return str(settings.read("NBTOOLS_STAGING_DIR") or tempfile.gettempdir())


def _existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def try_write(path: str) -> str | None:
    """Create and remove one file in ``path`` (or its nearest existing parent).

    Returns:
        None when that worked, else the reason in words.
    """
    where = _existing(path)
    if not os.path.isdir(where):
        return f"{where} is not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".nbtools-doctor-", dir=where)
    except OSError as exc:
        return f"cannot create a file in {where}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _directory(name: str, path: str, env: str, floor: int, floor_why: str) -> Finding:
    problem = try_write(path)
    details: dict[str, Any] = {"path": path, "exists": os.path.isdir(path)}
    if problem is not None:
        return Finding(
            name,
            Status.FAIL,
            f"{path} cannot be written: {problem}",
            f"set {env} to a writable local directory",
            details,
        )
    usage = shutil.disk_usage(_existing(path))
    details.update(free=usage.free, total=usage.total, floor=floor)
    summary = f"{path}: writable, {_gib(usage.free)} free of {_gib(usage.total)}"
    if usage.free < floor:
        return Finding(
            name,
            Status.WARN,
            summary + f", below {floor_why}",
            f"free some space or set {env} to a larger local disk",
            details,
        )
    return Finding(name, Status.OK, summary, "", details)


def check_cache(path: str | None = None) -> Finding:
    """The dataset cache directory: writable, and room above its free-space floor."""
    path = path or cache_location()
    try:
        floor = settings.read("NBTOOLS_CACHE_MIN_FREE_BYTES")
    except ValueError:
        floor = None  # the settings check reports the value
    if floor is None:
        try:
            floor = shutil.disk_usage(_existing(path)).total // 10
        except OSError:
            floor = 0
    return _directory(
        "cache dir",
        path,
        "NBTOOLS_CACHE_DIR",
        floor,
        f"the {_gib(floor)} the cache keeps free (nothing could be cached)",
    )


def check_staging(path: str | None = None) -> Finding:
    """The checkpoint staging directory: writable, and room for a save's shards."""
    return _directory(
        "staging dir",
        path or staging_location(),
        "NBTOOLS_STAGING_DIR",
        STAGING_FLOOR_BYTES,
        f"{_gib(STAGING_FLOOR_BYTES)}",
    )


def _tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    import mlflow

    # MLflow's default resolves against the working directory; nothing is created here.
    return str(mlflow.get_tracking_uri())


def check_mlflow() -> Finding:
    """Whether MLflow is installed and its store can be written, without opening it."""
    try:
        import mlflow  # noqa: F401 - installed at all?
    except ImportError:
        return Finding(
            "mlflow",
            Status.WARN,
            "MLflow is not installed: runs are not tracked",
            'pip install "nbtools-train[mlflow]"',
        )
    from nbtools.tracking import is_http, probe, sqlite_path

    uri = _tracking_uri()
    details: dict[str, Any] = {"uri": uri}
    if is_http(uri):
        try:
            probe(uri)
        except Exception as exc:  # noqa: BLE001 - any failure to reach it is the finding
            return Finding(
                "mlflow",
                Status.WARN,
                f"the tracking server {uri} does not answer",
                "start it, or set MLFLOW_TRACKING_URI to a running server or "
                "sqlite:////ABSOLUTE/PATH/mlflow.db",
                {**details, "error": str(exc)},
            )
        return Finding("mlflow", Status.OK, f"tracking server {uri} answers", "", details)
    path = sqlite_path(uri)
    if path is None and uri.startswith("file:"):
        path = uri[len("file:") :].lstrip("/")
        path = "/" + path if uri.startswith("file:/") else path
    if path is None:
        return Finding(
            "mlflow", Status.OK, f"store {uri} (not checked: not a local store)", "", details
        )
    details["path"] = path
    target = path if os.path.exists(path) else os.path.dirname(path) or "."
    problem = None
    if os.path.isfile(path):
        if not os.access(path, os.W_OK):
            problem = f"{path} is read-only"
    else:
        problem = try_write(target)
    if problem is not None:
        return Finding(
            "mlflow",
            Status.WARN,
            f"the MLflow store {uri} cannot be written: {problem}",
            "set MLFLOW_TRACKING_URI to a writable place, e.g. sqlite:////ABSOLUTE/PATH/mlflow.db",
            details,
        )
    where = "exists" if os.path.exists(path) else "would be created"
    advice = ""
    if not os.environ.get("MLFLOW_TRACKING_URI", "").strip():
        advice = (
            "MLflow's default store is relative to the working directory; set "
            "MLFLOW_TRACKING_URI to keep every run in one place"
        )
    return Finding("mlflow", Status.OK, f"store {uri}: writable ({where})", advice, details)
