"""The ``nbtools`` logger: rank-zero by default.

Library code logs through :func:`get_logger` and never prints. Records from
ranks other than 0 are dropped unless ``NBTOOLS_LOG_ALL_RANKS=1``. Both variables are read
through :mod:`nbtools._internal.settings`; a value it does not accept never breaks logging: the
logger keeps its default and says once what is wrong (``nbtools doctor`` shows it too).

A logger's filters see only the records logged on that logger itself, not those
that propagate up from its children, so the rank filter sits on every logger
:func:`get_logger` returns: a record of ``nbtools.checkpoint`` on rank 1 never
reaches the ``nbtools`` handler nor a handler of the root logger
(``logging.basicConfig()``).
"""

from __future__ import annotations

import logging

from nbtools._internal import settings

__all__ = ["get_logger"]

_ROOT = "nbtools"


def _setting(name: str, default: object) -> object:
    """A logging setting's value, or ``default`` when it is unset or not valid."""
    try:
        value = settings.read(name)
    except ValueError:
        return default
    return default if value is None else value


class _RankZeroFilter(logging.Filter):
    """Keeps a record only on global rank 0 (or everywhere with ``NBTOOLS_LOG_ALL_RANKS=1``),
    and a record logged with ``extra={"any_rank": True}`` (a condition of its rank alone)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "any_rank", False) or _setting("NBTOOLS_LOG_ALL_RANKS", False):
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
        root.setLevel(str(_setting("NBTOOLS_LOG_LEVEL", "WARNING")))
        root.propagate = True
        root._nbtools_configured = True  # type: ignore[attr-defined]
        for name in ("NBTOOLS_LOG_LEVEL", "NBTOOLS_LOG_ALL_RANKS"):
            try:
                settings.read(name)
            except ValueError as error:
                root.warning("%s; using the default", error)
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
