"""The ``nbtools`` logger: rank-zero by default.

Library code logs through :func:`get_logger` and never prints. Records from
ranks other than 0 are dropped unless ``NBTOOLS_LOG_ALL_RANKS=1``.

A logger's filters see only the records logged on that logger itself, not those
that propagate up from its children, so the rank filter sits on every logger
:func:`get_logger` returns: a record of ``nbtools.checkpoint`` on rank 1 never
reaches the ``nbtools`` handler nor a handler of the root logger
(``logging.basicConfig()``).
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger"]

_ROOT = "nbtools"


class _RankZeroFilter(logging.Filter):
    """Keeps a record only on global rank 0 (or everywhere with ``NBTOOLS_LOG_ALL_RANKS=1``),
    and a record logged with ``extra={"any_rank": True}`` (a condition of its rank alone)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("NBTOOLS_LOG_ALL_RANKS") == "1" or getattr(record, "any_rank", False):
            return True
        from nbtools.runtime import get_rank

        return get_rank() == 0


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_nbtools_configured", False):
        _add_rank_filter(root)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("nbtools: %(levelname)s: %(message)s"))
            handler.addFilter(_RankZeroFilter())
            root.addHandler(handler)
        root.setLevel(os.environ.get("NBTOOLS_LOG_LEVEL", "WARNING").upper())
        root.propagate = True
        root._nbtools_configured = True  # type: ignore[attr-defined]
    return root


def _add_rank_filter(logger: logging.Logger) -> logging.Logger:
    if not any(isinstance(f, _RankZeroFilter) for f in logger.filters):
        logger.addFilter(_RankZeroFilter())
    return logger


def get_logger(name: str | None = None) -> logging.Logger:
    """Return the ``nbtools`` logger or one of its children (``nbtools.<name>``), rank-zero filtered."""
    root = _configure_root()
    if not name or name == _ROOT:
        return root
    if name.startswith(_ROOT + "."):
        name = name[len(_ROOT) + 1 :]
    return _add_rank_filter(root.getChild(name))
