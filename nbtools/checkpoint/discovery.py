"""Finding checkpoints under a root: ``root/step_<N>/``, complete when ``.metadata`` is there.

A checkpoint counts only when its ``.metadata`` unpickles with the restricted
unpickler and every shard file it names is present and long enough, so a save
killed at any point is never picked. With ``verify``, every item's recorded
CRC-32 is checked as well (this reads all the data).

Only real directories count: nbtools never creates links, so a ``step_<N>``
that is a symbolic link (or holds one) was put there by someone else and is
never followed, read or deleted through; the link leads out of the root.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.checkpoint._shards import verify_items
from nbtools.checkpoint._target import LocalTarget, open_target
from nbtools.checkpoint.reader import read_metadata
from nbtools.checkpoint.writer import METADATA_NAME
from nbtools.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "find_latest_valid",
    "list_steps",
    "step_dir_name",
    "validate",
    "root_target",
    "is_foreign",
    "candidates",
]

_STEP_RE = re.compile(r"^step_(\d+)$")
_log = get_logger("checkpoint")
# Paths already reported as links, so a root scanned after every save warns once.
_reported: set[str] = set()


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step_{step}"


def root_target(root: str | os.PathLike[str]) -> Any:
    """The target for a checkpoint root; a root that is a file is a ``ValueError``."""
    target = open_target(root)
    if isinstance(target, LocalTarget) and target.isfile():
        raise ValueError(f"checkpoint root {target.root} is a file; give a directory path")
    return target


def is_foreign(target: Any, name: str) -> bool:
    """True when ``name`` under a local ``target`` is a symbolic link or not a directory.

    Such an entry was not made by nbtools: it is neither listed, read nor deleted.
    Object-store targets have no links.
    """
    if not isinstance(target, LocalTarget):
        return False
    try:
        mode = os.lstat(target.path(name)).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        return False
    path = target.path(name)
    if path not in _reported:
        _reported.add(path)
        what = (
            f"a symbolic link to {os.path.realpath(path)}"
            if stat.S_ISLNK(mode)
            else "not a directory"
        )
        _log.warning("ignoring %s: it is %s, not a checkpoint directory nbtools wrote", path, what)
    return True


def list_steps(target: Any) -> list[tuple[int, bool]]:
    """``(step, has_metadata)`` for every ``step_<N>`` directory, newest first.

    Symbolic links and files named like steps are left out (see :func:`is_foreign`).
    """
    out = []
    for name in target.listdir():
        match = _STEP_RE.match(name)
        if match and not is_foreign(target, name):
            out.append((int(match.group(1)), target.exists(f"{name}/{METADATA_NAME}")))
    return sorted(out, reverse=True)


def _local_size(target: LocalTarget, name: str) -> int:
    """Size of a regular file in a local checkpoint directory; a link is corrupt."""
    info = os.lstat(target.path(name))
    if stat.S_ISLNK(info.st_mode):
        raise CorruptCheckpointError(
            f"{target.url}: {name} is a symbolic link to {os.path.realpath(target.path(name))}; "
            "checkpoints nbtools wrote hold no links, so it is not read"
        )
    return info.st_size


def validate(target: Any, where: str, verify: bool = False) -> Any:
    """Metadata of a complete checkpoint directory; raises ``CorruptCheckpointError`` otherwise.

    Args:
        target: The checkpoint directory.
        where: How to name it in errors.
        verify: Also re-read every item and compare it with its recorded CRC-32
            (items of checkpoints written without checksums are not checked).
    """
    local = isinstance(target, LocalTarget)
    if local:
        try:
            _local_size(target, METADATA_NAME)
        except FileNotFoundError:
            pass  # read_metadata says what is missing
    metadata = read_metadata(target, where)
    ends: dict[str, int] = {}
    per_file: dict[str, list[Any]] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        per_file.setdefault(info.relative_path, []).append(info)
    for name, end in ends.items():
        try:
            size = _local_size(target, name) if local else target.size(name)
        except (FileNotFoundError, OSError):
            raise CorruptCheckpointError(
                f"{where}: shard {name} named in {METADATA_NAME} is missing"
            ) from None
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
    with a warning, and the previous checkpoint is used. Symbolic links named
    like checkpoints are ignored.

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
        UnsafeCheckpointError: A ``.metadata`` asks to unpickle a type outside DCP
            metadata (someone crafted it); nothing from it was run.
    """
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, not {type(verify).__name__}")
    found = next(candidates(root_target(root), verify), None)
    return found[0] if found else None


def candidates(target: Any, verify: bool = False) -> Iterator[tuple[str, int, Any]]:
    """``(url, step, metadata)`` of each complete checkpoint under ``target``, newest first.

    Checkpoints that fail validation are skipped with a warning.

    Raises:
        UnsafeCheckpointError: A crafted ``.metadata`` (not skipped: someone planted it).
    """
    for step, complete in list_steps(target):
        if not complete:
            continue
        child = target.child(step_dir_name(step))
        try:
            metadata = validate(child, child.url, verify)
        except UnsafeCheckpointError:
            raise
        except (CorruptCheckpointError, OSError) as exc:
            _log.warning("skipping checkpoint %s: %s", child.url, exc)
            continue
        yield child.url, step, metadata


def _latest(target: Any) -> tuple[str, int, Any] | None:
    """``(url, step, metadata)`` of the newest complete checkpoint under ``target``."""
    return next(candidates(target), None)
