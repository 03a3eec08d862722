"""Checking the arguments of ``CheckpointManager`` before anything is touched."""

from __future__ import annotations

import os
from typing import Any

from nbtools.checkpoint._target import LocalTarget
from nbtools.errors import CheckpointError

__all__ = ["positive", "check_step", "check_extra", "check_writable"]


def positive(name: str, value: int | None) -> int | None:
    """``value`` when it is None or an int of at least 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (or None), got {value}")
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


def check_writable(target: Any) -> None:
    """Refuse a local root that cannot be created or written (URLs are left to fsspec)."""
    if not isinstance(target, LocalTarget):
        return
    path = target.root
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint root {target.root} is not writable ({path} refuses writes)"
        )
