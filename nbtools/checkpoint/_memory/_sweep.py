"""Ending jobs' snapshots: a dead job's, swept by the next one; a finished launch's.

A job directory (see ``_slots``) records its keeper, the process whose life
bounds the job's snapshots. A manager that starts sweeps the directories whose
keeper is dead; the launcher drops a launch's directories when it ends for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from nbtools._internal.holder import Holder, Liveness
from nbtools.checkpoint._memory._slots import KEEPER, snapshot_base

__all__ = ["sweep", "drop_jobs"]


def sweep(user: str, own: str | None = None) -> list[str]:
    """Remove the job directories under ``user`` whose keeper process is dead; their names.

    ``own`` (this job's directory) is never removed: a restarted rank's keeper may
    differ from the one recorded, and the job goes on.
    """
    removed: list[str] = []
    try:
        names = os.listdir(user)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(user, name)
        if path == own:
            continue
        try:
            with open(os.path.join(path, KEEPER)) as fh:
                keeper = Holder.from_record(json.load(fh))
        except (OSError, ValueError):
            keeper = None
        if keeper is None or keeper.alive() is Liveness.DEAD:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def drop_jobs(prefix: str, base: str | None = None) -> list[str]:
    """Remove every job directory of this user whose key starts with ``prefix``; their names.

    The launcher's hook for a launch that ended for good (``"run:<run id>|"``):
    its snapshots serve no restart any more.
    """
    user = os.path.join(base or snapshot_base(), f"nbtools-snapshots-{os.geteuid()}")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(user):
            path = os.path.join(user, name)
            try:
                with open(os.path.join(path, KEEPER)) as fh:
                    key = json.load(fh).get("key")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(key, str) and key.startswith(prefix):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
    with contextlib.suppress(OSError):
        os.rmdir(user)  # when no job is left
    return removed
