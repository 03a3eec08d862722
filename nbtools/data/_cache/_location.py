"""Where the file cache lives, how much room it keeps free, and the checks that keep
it private to its user.

The default location is the user's own cache directory (``$NBTOOLS_CACHE_DIR``,
else ``$XDG_CACHE_HOME/nbtools``, else ``~/.cache/nbtools``), as pip and
Hugging Face do. Only when that cannot be created does it fall back to
``<temp dir>/nbtools-cache-<uid>``, a name other users can predict; the checks
below make that fallback as safe as the home location.

A cache directory is used only when it is owned by the current user and no
other user can write to it; nbtools creates it with mode 0700 and removes
read and search access for others from a directory it owns. A directory that
another user owns or can write to is refused: files planted in it would be
served as training data.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile

from nbtools._internal import settings
from nbtools.errors import CacheError

__all__ = [
    "ENV_DIR",
    "ENV_MIN_FREE",
    "default_cache_dir",
    "ensure_private_dir",
    "min_free_from_env",
]

ENV_DIR = "NBTOOLS_CACHE_DIR"
ENV_MIN_FREE = ("NBTOOLS_CACHE_MIN_FREE_BYTES", "SGC_FSLAYER_MIN_FREE_DISK_BYTES")


def min_free_from_env() -> int | None:
    """The free-space floor of the cache filesystem from the environment, or None when unset."""
    ours = settings.read(ENV_MIN_FREE[0])
    if ours is not None:
        return int(ours)
    name = ENV_MIN_FREE[1]
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be a number of bytes, e.g. 10000000000") from None
    if parsed < 0:
        raise ValueError(f"{name}={value!r} must not be negative")
    return parsed


def _home_cache_dir() -> str | None:
    explicit = settings.read(ENV_DIR)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "nbtools")
    home = os.path.expanduser("~")
    if home == "~" or not os.path.isabs(home):
        return None
    return os.path.join(home, ".cache", "nbtools")


def default_cache_dir() -> str:
    """The user's private cache directory, created if needed.

    ``$NBTOOLS_CACHE_DIR``, else ``$XDG_CACHE_HOME/nbtools``, else
    ``~/.cache/nbtools``; ``<temp dir>/nbtools-cache-<uid>`` only when none of
    those can be created.
    """
    preferred = _home_cache_dir()
    if preferred is not None:
        try:
            os.makedirs(preferred, mode=0o700, exist_ok=True)
        except OSError:
            if settings.read(ENV_DIR):
                raise
        else:
            return preferred
    return os.path.join(tempfile.gettempdir(), f"nbtools-cache-{os.getuid()}")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse(path: str, why: str) -> CacheError:
    exc = CacheError(
        f"refusing the cache directory {path!r}: {why}. Files another user can place there "
        "would be served as training data. Remove it, or pass cache_dir= (or set "
        f"{ENV_DIR}) to a directory of your own, e.g. ~/.cache/nbtools"
    )
    exc.errno = errno.EPERM
    return exc


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or check that the existing one is private to this user.

    Raises:
        CacheError: the directory cannot be created, is owned by another user,
            or is writable by another user (group or others).
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        err = CacheError(
            f"cannot create the cache directory {path!r}: {exc.strerror or exc}; "
            "pass cache_dir= on a writable local disk"
        )
        err.errno = exc.errno
        raise err from exc
    link = os.lstat(path)
    uid = os.getuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        raise _refuse(path, f"it is a symbolic link owned by {_owner(link.st_uid)}")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory")
    if st.st_uid != uid:
        raise _refuse(path, f"it is owned by {_owner(st.st_uid)}, not by you ({_owner(uid)})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(path, f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})")
    if st.st_mode & 0o077:
        # Only its owner could have written here: tighten it so the cached
        # copies are not readable by others either.
        os.chmod(path, 0o700)
