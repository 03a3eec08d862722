"""Local staging space: where shards are written before upload and after download.

The base directory is ``NBTOOLS_STAGING_DIR`` or the system temp dir. Each save
or load gets its own subdirectory, removed afterwards, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from nbtools._internal.fs import free_bytes, pid_alive
from nbtools.errors import StagingSpaceError

__all__ = ["staging_base", "staging_area", "check_space", "progress"]

# Free space kept in reserve beyond the estimate (filesystem overhead, other users).
_RESERVE_BYTES = 16 << 20
# Transfers below this size never show a progress bar.
_PROGRESS_MIN_BYTES = 256 << 20


def staging_base(staging_dir: str | os.PathLike[str] | None = None) -> str:
    """The directory under which per-save staging directories are created."""
    base = os.fspath(staging_dir) if staging_dir else os.environ.get("NBTOOLS_STAGING_DIR")
    return base or tempfile.gettempdir()


def check_space(base: str, needed: int, what: str) -> None:
    """Raise :class:`StagingSpaceError` unless ``base`` has room for ``needed`` bytes."""
    free = free_bytes(base)
    if needed + _RESERVE_BYTES > free:
        raise StagingSpaceError(
            f"{what} needs about {needed / 2**20:.1f} MiB of local staging space plus a "
            f"reserve of {_RESERVE_BYTES / 2**20:.1f} MiB kept free on that filesystem "
            f"({(needed + _RESERVE_BYTES) / 2**20:.1f} MiB in all), but {base} has "
            f"{free / 2**20:.1f} MiB free; free some space or point NBTOOLS_STAGING_DIR "
            "(or staging_dir=) at a larger local disk"
        )


_PREFIX = "nbtools-stage-"


def _sweep(base: str) -> None:
    """Remove staging directories of processes that died without cleaning up (e.g. SIGKILL)."""
    for name in os.listdir(base):
        pid = name[len(_PREFIX) :].split("-", 1)[0]
        if name.startswith(_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


@contextlib.contextmanager
def staging_area(base: str) -> Iterator[str]:
    """A fresh private directory under ``base``, removed on exit whatever happens.

    Directories left by dead processes are removed first.
    """
    os.makedirs(base, exist_ok=True)
    _sweep(base)
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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
