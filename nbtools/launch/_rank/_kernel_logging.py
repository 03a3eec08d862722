"""The kernel's logging configuration, carried into the ranks.

Ranks come from a forkserver (or a Ray worker), so a handler that a notebook
cell configured (``logging.basicConfig(level=logging.INFO, format=...)``) is
not there, and a rank's ``logging.info`` would be lost. Under ``torchrun`` a
script's module-level configuration runs in every worker; here the kernel's
root logger is described when ranks start (:func:`environment`, its level and
each handler's format and level) and set up again in each rank before the
user's function runs (:func:`apply`), with handlers writing to the rank's
stderr, so records reach the cell with the ``[rank N]`` prefix.

A pool's ranks live across calls: the description is sent again with a call
whenever the kernel's configuration changed since (``apply(text)``).

A function's own configuration wins: ``logging.basicConfig`` in the rank
replaces the kernel's handlers (as ``force=True`` would) as long as they are
the only ones. nbtools' own records keep their own handler and are not
printed twice.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

__all__ = ["ENV", "describe", "environment", "apply"]

#: The variable that carries the kernel's root logger configuration (JSON) to the ranks.
ENV = "NBTOOLS_KERNEL_LOGGING"
_OWN = "nbtools"


def environment() -> dict[str, str]:
    """``{ENV: json}`` describing the kernel's root logger, or ``{}`` when it is the default."""
    text = describe()
    return {ENV: text} if text else {}


def describe() -> str:
    """The kernel's root logger as JSON (its level, each handler's format), or ``""``: the default.

    A pool sends it again with a call when it changed since its ranks last got it, so
    a configuration made after the pool started reaches its ranks too.
    """
    root = logging.getLogger()
    handlers = []
    for handler in root.handlers:
        if getattr(handler, "_nbtools_kernel", False):
            continue
        formatter = handler.formatter or logging.Formatter()
        style = (
            "{"
            if isinstance(formatter._style, logging.StrFormatStyle)
            else "$"
            if isinstance(formatter._style, logging.StringTemplateStyle)
            else "%"
        )
        handlers.append(
            {
                "format": formatter._fmt,
                "datefmt": formatter.datefmt,
                "style": style,
                "level": handler.level,
            }
        )
    if not handlers and root.level == logging.WARNING:
        return ""
    unique = [h for i, h in enumerate(handlers) if h not in handlers[:i]]
    return json.dumps({"level": root.level, "handlers": unique})


def apply(text: str | None = None) -> None:
    """In a rank: configure the root logger as the kernel's is (see the module docstring).

    Args:
        text: a :func:`describe` of the kernel's logging; default: the one the rank
            started with (``$NBTOOLS_KERNEL_LOGGING``). It replaces what an earlier
            description set up; a configuration the rank's own code made is kept.
    """
    if text is None:
        text = os.environ.get(ENV, "")
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_nbtools_kernel", False)]
    if len(ours) < len(root.handlers):
        return  # the rank's code configured logging itself: its configuration wins
    for handler in ours:
        root.removeHandler(handler)
    if not text:
        if ours:
            root.setLevel(logging.WARNING)  # the kernel went back to Python's defaults
        return
    try:
        config = json.loads(text)
        for spec in config["handlers"]:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(
                logging.Formatter(spec["format"], spec["datefmt"], style=spec["style"])
            )
            handler.setLevel(int(spec["level"]))
            handler.addFilter(_not_own)
            handler._nbtools_kernel = True  # type: ignore[attr-defined]
            root.addHandler(handler)
        root.setLevel(int(config["level"]))
    except (ValueError, KeyError, TypeError):
        return  # an unreadable description: the rank keeps Python's defaults
    _let_basic_config_replace()


def _not_own(record: logging.LogRecord) -> bool:
    # nbtools' records have a handler of their own (and propagate): shown once, not twice.
    return record.name != _OWN and not record.name.startswith(_OWN + ".")


def _let_basic_config_replace() -> None:
    original = logging.basicConfig
    if getattr(original, "_nbtools_wrapped", False):
        return

    def basicConfig(**kwargs: Any) -> None:  # the name it stands in for
        handlers = logging.getLogger().handlers
        if handlers and all(getattr(h, "_nbtools_kernel", False) for h in handlers):
            kwargs.setdefault("force", True)  # the function's own configuration wins
        original(**kwargs)

    basicConfig._nbtools_wrapped = True  # type: ignore[attr-defined]
    basicConfig.__doc__ = original.__doc__
    logging.basicConfig = basicConfig  # type: ignore[assignment]
