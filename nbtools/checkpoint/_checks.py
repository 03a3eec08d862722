"""Checking the arguments of ``CheckpointManager`` before anything is touched."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from nbtools._internal.location import unwritable_reason
from nbtools.checkpoint._lease import LeasePending
from nbtools.checkpoint._storage import METADATA_NAME, Target
from nbtools.errors import CheckpointError

__all__ = [
    "positive",
    "non_negative",
    "check_step",
    "check_extra",
    "check_writable",
    "save_verdict",
    "SaveCase",
    "SaveVerdict",
]


def positive(name: str, value: int | None) -> int | None:
    """``value`` when it is None or an int of at least 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (or None), got {value}")
    return value


def non_negative(name: str, value: int | None) -> int | None:
    """``value`` when it is None or an int of at least 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be at least 0 (or None), got {value}")
    return value


def check_step(step: Any) -> int:
    """``step`` when it is a non-negative int."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be a non-negative int, got {step}")
    return step


def check_extra(extra: Any) -> None:
    """Refuse an ``extra`` that is neither None nor a dict."""
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, not {type(extra).__name__}")


def check_writable(target: Target) -> None:
    """Refuse a root on this machine's filesystem that cannot be created or written.

    Object stores are left to fsspec: their permissions show on the first write.
    """
    if target.local_path is None:
        return
    reason = unwritable_reason(target.local_path)
    if reason is not None:
        raise CheckpointError(f"checkpoint root {target.url} is not writable ({reason})")


class SaveCase(enum.Enum):
    """What a save does, as rank 0 found it before the save (every rank acts alike)."""

    #: No checkpoint of this step yet: the save writes a new one.
    NEW = "new"
    #: A complete checkpoint of this step exists: the save replaces it atomically.
    REPLACE = "replace"
    #: Another machine's lease on the root is still being watched: save later.
    DEFER = "defer"
    #: The save must not happen: every rank raises :attr:`SaveVerdict.error`.
    REFUSE = "refuse"


@dataclass(frozen=True)
class SaveVerdict:
    """Rank 0's verdict before a save, sent to every rank.

    Attributes:
        case: what the save does.
        error: why it waits (``DEFER``) or is refused (``REFUSE``); else None.
    """

    case: SaveCase
    error: Exception | None = None


def save_verdict(target: Target, lease: Any, root: str, name: str, foreign: Any) -> SaveVerdict:
    """On rank 0 before a save: whether it writes a new checkpoint, replaces one, waits or is refused.

    Errors are returned in the verdict, not raised, so that every rank raises the
    same one instead of the others hanging in the next collective. ``foreign``
    tells whether ``name`` under ``target`` is a link or a file (never written through).
    """
    try:
        if lease is not None:
            lease.acquire()
        if foreign(target, name):
            raise CheckpointError(
                f"{root}/{name} is a symbolic link or a file, not a checkpoint directory "
                "nbtools wrote; nothing is written through it. Remove it, or save elsewhere"
            )
        exists = target.exists(f"{name}/{METADATA_NAME}")
    except LeasePending as exc:
        return SaveVerdict(SaveCase.DEFER, exc)
    except Exception as exc:  # noqa: BLE001 - every rank must raise it, not hang
        return SaveVerdict(SaveCase.REFUSE, exc)
    return SaveVerdict(SaveCase.REPLACE if exists else SaveCase.NEW)
