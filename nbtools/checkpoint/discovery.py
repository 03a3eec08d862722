"""Finding checkpoints under a root: ``root/step_<N>/``, complete when ``.metadata`` is there.

A checkpoint counts only when its ``.metadata`` unpickles with the restricted
unpickler and every shard file it names is present and long enough, so a save
killed at any point is never picked. With ``verify``, every item's recorded
CRC-32 is checked as well (this reads all the data).

Only the user's own checkpoints count: one another user wrote (or can write) is
skipped with a warning (see ``_roots``). Only real directories count: nbtools never creates links, so a ``step_<N>``
that is a symbolic link (or holds one) was put there by someone else and is
never followed, read or deleted through; the link leads out of the root.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterator
from typing import Any, NamedTuple

from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage import (
    METADATA_NAME,
    Target,
    open_target,
    parse_step_dir,
    read_metadata,
    skip_untrusted,
    step_dir_name,
    verify_items,
)
from nbtools.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "FoundCheckpoint",
    "find_latest_valid",
    "latest_checkpoint",
    "list_steps",
    "validate",
    "root_target",
    "RootCheck",
    "is_foreign",
    "candidates",
]

_log = get_logger("checkpoint")
# Paths already reported as links, so a root scanned after every save warns once.
_reported: set[str] = set()


class FoundCheckpoint(NamedTuple):
    """A complete checkpoint under a root: its step and its directory (path or URL)."""

    step: int
    path: str


def root_target(root: str | os.PathLike[str] | Target) -> Target:
    """The target for a checkpoint root; a root that is a file is a ``ValueError``."""
    target = open_target(root)
    if target.isfile():
        raise ValueError(_a_file(target))
    return target


def _a_file(target: Target) -> str:
    return f"checkpoint root {target.url} is a file; give a directory path"


class RootCheck:
    """Refuses a checkpoint root that is a file, as :func:`root_target` does, without
    asking an object store before it must.

    On this machine's filesystem the check is a ``stat``, done at once. In an object
    store it is a request, and a fresh process's first one also starts the client
    (most of a CPU second): it waits for the first read or write of the volume, so
    that a restarted rank that restores from memory never pays for it. :meth:`result`
    gives the target, or raises what the check found (``ValueError`` for a file);
    call it before the first read or write of the volume.
    """

    def __init__(self, root: str | os.PathLike[str] | Target) -> None:
        self.target = open_target(root)
        self._lock = threading.Lock()
        self._done = False
        if self.target.local_path is not None:
            self.result()

    def result(self) -> Target:
        """The root's target once the check passed (checks on the first call)."""
        with self._lock:
            if not self._done:
                if self.target.isfile():
                    raise ValueError(_a_file(self.target))
                self._done = True
        return self.target


def is_foreign(target: Target, name: str) -> bool:
    """True when the entry ``name`` of ``target`` is a symbolic link or not a directory.

    Such an entry was not made by nbtools: it is neither listed, read nor deleted.
    """
    why = target.foreign(name)
    if why is None:
        return False
    where = f"{target.url}/{name}"
    if where not in _reported:
        _reported.add(where)
        _log.warning("ignoring %s: it is %s, not a checkpoint directory nbtools wrote", where, why)
    return True


def list_steps(target: Target) -> list[tuple[int, bool]]:
    """``(step, has_metadata)`` for every ``step_<N>`` directory, newest first.

    Symbolic links and files named like steps are left out (see :func:`is_foreign`),
    and so are checkpoints another user wrote or can write (see ``_roots``).
    """
    out = []
    for name in target.listdir():
        step = parse_step_dir(name)
        if step is not None and not is_foreign(target, name) and not skip_untrusted(target, name):
            out.append((step, target.exists(f"{name}/{METADATA_NAME}")))
    return sorted(out, reverse=True)


def _refuse_link(target: Target, name: str, where: str) -> None:
    dest = target.link(name)
    if dest is not None:
        raise CorruptCheckpointError(
            f"{where}: {name} is a symbolic link to {dest}; checkpoints nbtools wrote hold no "
            "links, so it is not read"
        )


def _size(target: Target, name: str, where: str) -> int:
    """Size of a file of a checkpoint directory; a link is corrupt, a missing file too."""
    _refuse_link(target, name, where)
    try:
        return target.size(name)
    except OSError:
        raise CorruptCheckpointError(
            f"{where}: shard {name} named in {METADATA_NAME} is missing"
        ) from None


def validate(target: Target, where: str, verify: bool = False) -> Any:
    """Metadata of a complete checkpoint directory; raises ``CorruptCheckpointError`` otherwise.

    Args:
        target: The checkpoint directory.
        where: How to name it in errors.
        verify: Also re-read every item and compare it with its recorded CRC-32
            (items of checkpoints written without checksums are not checked).
    """
    _refuse_link(target, METADATA_NAME, where)
    metadata = read_metadata(target, where)
    ends: dict[str, int] = {}
    per_file: dict[str, list[Any]] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        per_file.setdefault(info.relative_path, []).append(info)
    for name, end in ends.items():
        size = _size(target, name, where)
        if size < end:
            raise CorruptCheckpointError(
                f"{where}: shard {name} is truncated ({size} < {end} bytes)"
            )
    if verify:
        for name, infos in sorted(per_file.items()):
            with target.open_read(name) as fh:
                verify_items(fh, infos, where)
    return metadata


def find_latest_valid(root: str | os.PathLike[str], *, verify: bool = False) -> str | None:
    """The newest complete checkpoint directory under ``root``, or None.

    Directories without ``.metadata`` (saves that did not finish) are ignored; a
    ``.metadata`` that cannot be read or names missing or short shards is skipped
    with a warning, and the previous checkpoint is used; so is a ``.metadata``
    that asks to unpickle a type outside DCP metadata (someone crafted it;
    nothing from it runs). Symbolic links named like checkpoints are ignored.

    Example:
        >>> find_latest_valid("/mnt/vol/run1/checkpoints")  # doctest: +SKIP
        '/mnt/vol/run1/checkpoints/step_1200'
        >>> find_latest_valid("/mnt/vol/run1/checkpoints", verify=True)  # doctest: +SKIP
        '/mnt/vol/run1/checkpoints/step_1100'

    Args:
        root: The checkpoint root (path or fsspec URL).
        verify: Also check every item against its recorded CRC-32, skipping
            checkpoints whose data was damaged. Off by default: it reads all
            the data of each checkpoint it looks at.

    Raises:
        ValueError: ``root`` is a file.
        TypeError: ``verify`` is not a bool.
    """
    found = latest_checkpoint(root, verify=verify)
    return found.path if found is not None else None


def latest_checkpoint(
    root: str | os.PathLike[str], *, verify: bool = False
) -> FoundCheckpoint | None:
    """The step and directory of the newest complete checkpoint under ``root``, or None.

    The same checkpoint :func:`find_latest_valid` names, with its step, so
    callers never parse a step back out of a path.

    Example:
        >>> latest_checkpoint("/mnt/vol/run1/checkpoints")  # doctest: +SKIP
        FoundCheckpoint(step=1200, path='/mnt/vol/run1/checkpoints/step_1200')
        >>> step, path = latest_checkpoint("/mnt/vol/run1/checkpoints")  # doctest: +SKIP

    Args:
        root: The checkpoint root (path or fsspec URL).
        verify: Also check every item against its recorded CRC-32 (reads all the data).

    Raises:
        ValueError: ``root`` is a file.
        TypeError: ``verify`` is not a bool.
    """
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, not {type(verify).__name__}")
    found = next(candidates(root_target(root), verify), None)
    return FoundCheckpoint(found[0], found[1].url) if found is not None else None


def _vanished(directory: Target) -> bool:
    """Whether a checkpoint that was listed as complete has lost its ``.metadata`` since."""
    try:
        return not directory.exists(METADATA_NAME)
    except OSError:
        return False


def _listed_exists(target: Target, step: int) -> bool:
    """Whether the directory of a listed ``step`` is still there (errors: assume so)."""
    try:
        return target.exists(step_dir_name(step))
    except OSError:
        return True


def candidates(
    target: Target, verify: bool = False, skip: Collection[int] = ()
) -> Iterator[tuple[int, Target, Any]]:
    """``(step, directory, metadata)`` of each complete checkpoint under ``target``, newest first.

    Checkpoints that fail validation are skipped with a warning saying why: damaged
    ones, and unsafe ones (a ``.metadata`` the restricted unpickler refuses, which
    someone crafted; nothing from it ran). One deleted while it is validated (the
    retention of a run saving there) is no fault, nor is one deleted between the
    listing and the check that it is complete: the root is listed again, so a
    newer checkpoint published meanwhile is found.

    Args:
        target: The checkpoint root.
        verify: Also check every item's checksum.
        skip: Steps not to yield (already tried).
    """
    tried = set(skip)
    while True:
        relist = False
        for step, complete in list_steps(target):
            if step in tried:
                continue
            if not complete:
                if not _listed_exists(target, step):  # deleted since the listing: list again,
                    relist = True  # a newer one may have been published meanwhile
                    break
                continue
            tried.add(step)
            child = target.child(step_dir_name(step))
            try:
                metadata = validate(child, child.url, verify)
            except (CorruptCheckpointError, OSError) as exc:
                if _vanished(child):
                    _log.info(
                        "%s was deleted while it was read; looking for a newer one", child.url
                    )
                    relist = True
                    break
                unsafe = " as unsafe" if isinstance(exc, UnsafeCheckpointError) else ""
                _log.warning("skipping checkpoint %s%s: %s", child.url, unsafe, exc)
                continue
            yield step, child, metadata
        if not relist:
            return
