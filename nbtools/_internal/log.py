"""The ``nbtools`` logger: rank-zero by default.

Library code logs through :func:`get_logger` and never prints. Records from
ranks other than 0 are dropped unless ``NBTOOLS_LOG_ALL_RANKS=1``.
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger"]

_ROOT = "nbtools"


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("NBTOOLS_LOG_ALL_RANKS") == "1":
            return True
        from nbtools.runtime import get_rank

        return get_rank() == 0


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_nbtools_configured", False):
        root.addFilter(_RankZeroFilter())
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("nbtools: %(levelname)s: %(message)s"))
            handler.addFilter(_RankZeroFilter())
            root.addHandler(handler)
        root.setLevel(os.environ.get("NBTOOLS_LOG_LEVEL", "WARNING").upper())
        root.propagate = True
        root._nbtools_configured = True  # type: ignore[attr-defined]
    return root


def get_logger(name: str | None = None) -> logging.Logger:
    """Return the ``nbtools`` logger or one of its children (``nbtools.<name>``)."""
    root = _configure_root()
    if not name or name == _ROOT:
        return root
    if name.startswith(_ROOT + "."):
        name = name[len(_ROOT) + 1 :]
    return root.getChild(name)
