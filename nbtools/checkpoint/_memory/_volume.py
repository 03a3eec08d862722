"""What a job's ranks know of the volume, kept beside their snapshots.

A restore from memory must not pass over a newer checkpoint on the volume.
Listing the volume answers that, but it costs round trips, and in a restarted
process the start of the object store's client, on the path of every restart.
The ranks of the job know the answer already: the newest step the volume held
when the job last looked (every restore lists the volume or learns the answer
here), and the step of every volume save they started since, which is written
down before the save begins. So each rank keeps one number, the *bound*: no
checkpoint of this job on the volume is newer. It lives in a small record in
its node's job directory (``volume-r<rank>.json``, private like the slots).

A restore whose chosen snapshot is at least as new as the bound of the records
the ranks find needs no listing. Without any record (a job that never restored,
a job on new nodes), the volume is listed as before. Only this job's saves add
checkpoints under its root while it runs (the root's writer lease keeps other
machines out), so the bound holds for as long as the job does.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat

__all__ = ["write", "read", "combine", "remove", "is_record"]

_PREFIX = "volume-r"
#: A record is a few dozen bytes; anything larger was not written here.
_MAX_BYTES = 4096


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{rank}.json")


def is_record(name: str) -> bool:
    """Whether a file name in a job directory is a volume record (or one half-written)."""
    return name.startswith(_PREFIX)


def write(directory: str, key: str, rank: int, bound: int | None) -> None:
    """Record ``bound`` for ``rank`` (atomically: the old record or the new one)."""
    path = _path(directory, rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "rank": rank, "bound": bound}, fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _load(path: str) -> dict | None:
    """A record file's content when this user wrote it and nobody else can; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as fh:
        info = os.fstat(fh.fileno())
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_mode & 0o077
            or info.st_size > _MAX_BYTES
        ):
            return None
        try:
            data = json.load(fh)
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


def read(directory: str, key: str) -> tuple[bool, int | None]:
    """``(known, bound)`` from the trusted records of the job ``key`` in ``directory``:
    ``known`` is False when there is none; ``bound`` is the newest step any names
    (None: the volume held no checkpoint of the job)."""
    known, bound = False, None
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return known, bound
    for name in names:
        if not (is_record(name) and name.endswith(".json")):
            continue
        data = _load(os.path.join(directory, name))
        if data is None or data.get("key") != key:
            continue
        value = data.get("bound")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            continue
        known = True
        if value is not None:
            bound = value if bound is None else max(bound, value)
    return known, bound


def combine(views: list[tuple[bool, int | None]]) -> tuple[bool, int | None]:
    """What the records of every rank's node say together (see :func:`read`)."""
    known = [bound for seen, bound in views if seen]
    steps = [b for b in known if b is not None]
    return bool(known), max(steps, default=None)


def remove(directory: str, rank: int) -> None:
    """Drop ``rank``'s record (absent is fine)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(directory, rank))
