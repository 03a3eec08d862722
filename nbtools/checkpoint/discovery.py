"""Finding checkpoints under a root: ``root/step_<N>/``, complete when ``.metadata`` is there.

A checkpoint counts only when its ``.metadata`` unpickles with the restricted
unpickler and every shard file it names is present and long enough, so a save
killed at any point is never picked.
"""

from __future__ import annotations

import os
import re
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.checkpoint._target import LocalTarget, open_target
from nbtools.checkpoint.reader import read_metadata
from nbtools.checkpoint.writer import METADATA_NAME
from nbtools.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["find_latest_valid", "list_steps", "step_dir_name", "validate", "root_target"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_log = get_logger("checkpoint")


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step_{step}"


def root_target(root: str | os.PathLike[str]) -> Any:
    """The target for a checkpoint root; a root that is a file is a ``ValueError``."""
    target = open_target(root)
    if isinstance(target, LocalTarget) and target.isfile():
        raise ValueError(f"checkpoint root {target.root} is a file; give a directory path")
    return target


def list_steps(target: Any) -> list[tuple[int, bool]]:
    """``(step, has_metadata)`` for every ``step_<N>`` directory, newest first."""
    out = []
    for name in target.listdir():
        match = _STEP_RE.match(name)
        if match:
            out.append((int(match.group(1)), target.exists(f"{name}/{METADATA_NAME}")))
    return sorted(out, reverse=True)


def validate(target: Any, where: str) -> Any:
    """Metadata of a complete checkpoint directory; raises ``CorruptCheckpointError`` otherwise."""
    metadata = read_metadata(target, where)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        try:
            size = target.size(name)
        except (FileNotFoundError, OSError):
            raise CorruptCheckpointError(
                f"{where}: shard {name} named in {METADATA_NAME} is missing"
            ) from None
        if size < end:
            raise CorruptCheckpointError(
                f"{where}: shard {name} is truncated ({size} < {end} bytes)"
            )
    return metadata


def find_latest_valid(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint directory under ``root``, or None.

    Directories without ``.metadata`` (saves that did not finish) are ignored; a
    ``.metadata`` that cannot be read or names missing shards is skipped with a
    warning, and the previous checkpoint is used.

    Example:
        >>> find_latest_valid("/mnt/vol/run1/checkpoints")  # doctest: +SKIP
        '/mnt/vol/run1/checkpoints/step_1200'

    Raises:
        ValueError: ``root`` is a file.
        UnsafeCheckpointError: A ``.metadata`` asks to unpickle a type outside DCP
            metadata (someone crafted it); nothing from it was run.
    """
    found = _latest(root_target(root))
    return found[0] if found else None


def _latest(target: Any) -> tuple[str, int, Any] | None:
    """``(url, step, metadata)`` of the newest complete checkpoint under ``target``."""
    for step, complete in list_steps(target):
        if not complete:
            continue
        child = target.child(step_dir_name(step))
        try:
            metadata = validate(child, child.url)
        except UnsafeCheckpointError:
            raise
        except (CorruptCheckpointError, OSError) as exc:
            _log.warning("skipping checkpoint %s: %s", child.url, exc)
            continue
        return child.url, step, metadata
    return None
