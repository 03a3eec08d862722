"""Where data lives: a local (or mounted) path, or an fsspec URL of another filesystem.

One notion of a storage location for every package: ``"/mnt/vol/x"``,
``"relative/x"`` and ``"file:///mnt/vol/x"`` are local paths; ``"s3://b/x"``,
``"memory://x"`` and chained URLs such as ``"simplecache::s3://b/x"`` are
URLs, handed to fsspec. Stdlib only: nothing here imports fsspec.
"""

from __future__ import annotations

import os

__all__ = ["is_url", "local_path", "url_protocols", "nearest_existing", "unwritable_reason"]

_FILE_SCHEME = "file://"


def _text(location: str | os.PathLike[str]) -> str:
    text = os.fspath(location)
    if not isinstance(text, str):
        raise TypeError(f"a location must be a str or os.PathLike[str], not {type(text).__name__}")
    return text


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for a URL of a filesystem other than the local one (``file://`` is local).

    Args:
        location: A path, a ``file://`` URL, or an fsspec URL (chained ones included).
    """
    text = _text(location)
    if text.startswith(_FILE_SCHEME):
        return False
    return "://" in text or "::" in text


def local_path(location: str | os.PathLike[str]) -> str | None:
    """The absolute local path of ``location``, or None when it is a URL of another filesystem.

    ``~`` is expanded; a ``file://`` prefix is removed.
    """
    text = _text(location)
    if is_url(text):
        return None
    if text.startswith(_FILE_SCHEME):
        text = text[len(_FILE_SCHEME) :]
    return os.path.abspath(os.path.expanduser(text))


def url_protocols(location: str | os.PathLike[str]) -> list[str]:
    """The protocols of a URL, outermost first (``["simplecache", "s3"]``); [] for local paths."""
    text = _text(location)
    if not is_url(text):
        return []
    return [part.split("://", 1)[0] if "://" in part else part for part in text.split("::")]


def nearest_existing(path: str) -> str | None:
    """``path`` or its nearest existing ancestor (None when not even ``/`` is found)."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    return probe


def unwritable_reason(path: str) -> str | None:
    """Why a directory cannot be created or written at local ``path``; None when it can.

    The directory itself when it exists, else the nearest existing ancestor it
    would be created in, must be a directory this process may write and search.
    """
    probe = nearest_existing(path)
    if probe is None:
        return f"no part of {path} exists"
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} refuses writes"
    return None
