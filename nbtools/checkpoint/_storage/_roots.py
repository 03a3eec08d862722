"""Whose checkpoints a root holds: roots other users can write, and checkpoints they wrote.

A checkpoint restored is code and data put into the user's model: one another
user placed under the root must not be restored silently. The rule follows the
file cache's (a directory another user can write to is refused), adapted to
roots that are shared volumes and container bind mounts:

- a local root that users other than its owner can write to (mode ``o+w``,
  e.g. 0777) is refused by ``CheckpointManager``: anyone could place a
  checkpoint there or delete the run's. ``find_latest_valid`` still reads it,
  with a warning, and checks every checkpoint's owner as below;
- a checkpoint directory (or its ``.metadata``) owned by anyone other than
  this user, root, or the root directory's owner, or writable by other users,
  is skipped like a damaged one, with a warning naming the owner.

Object stores are left to their own permissions (there is no owner to check).
"""

from __future__ import annotations

import os
import stat

from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage._layout import METADATA_NAME
from nbtools.checkpoint._storage._target import Target
from nbtools.errors import CheckpointError

__all__ = ["check_root", "open_root_reason", "untrusted_reason", "skip_untrusted"]

_log = get_logger("checkpoint")
# Roots and checkpoints already reported, so a root scanned after every save warns once.
_reported: set[str] = set()


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def open_root_reason(target: Target) -> str | None:
    """Why other users can write to the local root ``target``, or None (also for URLs)."""
    if target.local_path is None:
        return None
    try:
        st = os.stat(target.local_path)
    except OSError:
        return None  # not created yet: nbtools creates it with the user's umask
    if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IWOTH:
        return None
    return (
        f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o}, owned by "
        f"{_owner(st.st_uid)})"
    )


def check_root(target: Target) -> None:
    """Refuse a local checkpoint root that users other than its owner can write to.

    Raises:
        CheckpointError: The root is writable by others (mode ``o+w``).
    """
    why = open_root_reason(target)
    if why is not None:
        raise CheckpointError(
            f"refusing the checkpoint root {target.url}: {why}. A checkpoint another user "
            "places there would be restored into your model, and they could delete yours. "
            "Use a directory of your own (mkdir -m 700 DIR), or, if this one is yours, "
            f"chmod o-w {target.local_path}"
        )


def _trusted(target: Target) -> set[int]:
    trusted = {os.geteuid(), 0}
    try:
        trusted.add(os.stat(target.local_path or "").st_uid)
    except OSError:
        pass
    return trusted


def untrusted_reason(target: Target, name: str) -> str | None:
    """Why the checkpoint ``name`` under the local root ``target`` is not to be restored, or None.

    It is untrusted when its directory or ``.metadata`` belongs to a user other
    than this one, root and the root's owner, or other users can write to it.
    A root other users can write to is warned about once (see :func:`check_root`).
    """
    if target.local_path is None:
        return None
    opened = open_root_reason(target)
    if opened is not None and target.url not in _reported:
        _reported.add(target.url)
        _log.warning(
            "the checkpoint root %s is open to other users: %s; checkpoints they wrote are skipped",
            target.url,
            opened,
        )
    trusted = _trusted(target)
    for rel in (name, f"{name}/{METADATA_NAME}"):
        try:
            st = os.lstat(os.path.join(target.local_path, rel))
        except OSError:
            continue  # gone or absent: discovery decides
        if st.st_uid not in trusted:
            return f"{rel} is owned by {_owner(st.st_uid)}, not by you, root or the root's owner"
        if st.st_mode & stat.S_IWOTH:
            return f"other users can write to {rel} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def skip_untrusted(target: Target, name: str) -> bool:
    """True (with one warning per checkpoint) when :func:`untrusted_reason` finds a reason."""
    why = untrusted_reason(target, name)
    if why is None:
        return False
    where = f"{target.url}/{name}"
    if where not in _reported:
        _reported.add(where)
        _log.warning(
            "skipping checkpoint %s as unsafe: %s; a checkpoint another user wrote is "
            "neither restored nor deleted. Remove it if it is not yours",
            where,
            why,
        )
    return True
