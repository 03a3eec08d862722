"""Ending jobs' snapshots: a dead job's, swept by the next one; a finished launch's.

A job directory (see ``_slots``) records its keeper, the process whose life
bounds the job's snapshots. A manager that starts sweeps the directories whose
keeper is dead, in this user's snapshot directory and in its private fallbacks
(``_slots.private_dir``); the launcher drops a launch's directories when it ends
for good (:func:`drop_jobs`).

A job directory appears whole, with its keeper (``_slots.job_dir`` makes it under
a temporary name ``.new-...`` and renames it into place): the sweep removes a
directory without a keeper record (one being dropped), but leaves one still being
made alone until it is a minute old (its maker was killed before it recorded the
keeper).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time

from nbtools._internal.holder import Holder, Liveness
from nbtools.checkpoint._memory._slots import KEEPER, NEW, snapshot_base, trusted, user_prefix

__all__ = ["sweep", "sweep_all", "drop_jobs", "user_dirs"]

#: Seconds after which a directory still being made, with no keeper, is a killed maker's.
STALE_NEW_S = 60.0


def _remove(path: str) -> bool:
    """Remove ``path`` (a directory and all it holds, or a file); whether it is gone.

    Tries again when the directory filled while it was removed (a dead job's rank that
    still ran for a moment).
    """
    for _ in range(5):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return True
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return not os.path.lexists(path)


def _keeper(path: str) -> tuple[Holder | None, str | None]:
    """The keeper recorded in the job directory ``path`` and the job's key (None: none)."""
    try:
        with open(os.path.join(path, KEEPER)) as fh:
            record = json.load(fh)
        key = record.get("key")
        return Holder.from_record(record), key if isinstance(key, str) else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None, None


def sweep(user: str, own: str | None = None) -> list[str]:
    """Remove the job directories under ``user`` whose keeper process is dead; their names.

    ``own`` (this job's directory) is never removed: a restarted rank's keeper may
    differ from the one recorded, and the job goes on.
    """
    removed: list[str] = []
    try:
        names = os.listdir(user)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(user, name)
        if path == own:
            continue
        keeper, _ = _keeper(path)
        if keeper is None and name.startswith(NEW):
            try:
                young = time.time() - os.lstat(path).st_mtime < STALE_NEW_S
            except FileNotFoundError:  # renamed into place meanwhile
                continue
            if young:
                continue
        if keeper is None or keeper.alive() is Liveness.DEAD:
            _remove(path)
            removed.append(name)
    return removed


def user_dirs(base: str | None = None) -> list[str]:
    """This user's trusted snapshot directories under ``base``: the usual one and any
    private fallback (see ``_slots.private_dir``)."""
    base = base or snapshot_base()
    prefix = user_prefix()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = [n for n in names if n == prefix or n.startswith(f"{prefix}-")]
    return [os.path.join(base, n) for n in sorted(found) if trusted(os.path.join(base, n))]


def _drop_if_empty(user: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(user)


def sweep_all(base: str | None = None, own: str | None = None) -> list[str]:
    """:func:`sweep` every trusted snapshot directory of this user under ``base``; a
    fallback left empty goes too. The job directories removed."""
    removed = []
    for user in user_dirs(base):
        removed += sweep(user, own)
        if own is None or os.path.dirname(own) != user:
            _drop_if_empty(user)
    return removed


def drop_jobs(prefix: str, base: str | None = None) -> list[str]:
    """Remove every job directory of this user under ``base`` (default: the snapshot base)
    whose key starts with ``prefix``, in every snapshot directory of this user there; their
    names.

    The launcher's hook for a launch that ended for good (``"run:<run id>|"``):
    its snapshots serve no restart any more.
    """
    removed = []
    for user in user_dirs(base):
        with contextlib.suppress(OSError):
            for name in os.listdir(user):
                path = os.path.join(user, name)
                _, key = _keeper(path)
                if key is not None and key.startswith(prefix) and _remove(path):
                    removed.append(name)
        _drop_if_empty(user)  # when no job is left
    return removed
