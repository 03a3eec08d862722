"""How nbtools calls DCP: its errors turned into nbtools errors, its single-process warning quieted.

Every ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` nbtools makes (the
manager's saves, the restores, :func:`~nbtools.checkpoint.export`) goes through
the two helpers here:

- :func:`unwrap`: DCP raises a ``CheckpointException`` (a ``BaseException``)
  holding each rank's failure; the caller raises what :func:`unwrap` returns
  instead, the first nbtools error of any rank, else a ``CheckpointError``
  naming the rank and what failed.
- :func:`quiet_single_process_warning`: without a process group,
  ``dcp.save``/``dcp.load`` warn on every call that they assume one process,
  which is exactly what a notebook without ``@distributed`` intends. Importing
  nbtools changes no warning filter; the manager calls it just before it saves
  or restores without a process group.

Why a filter and not ``warnings.catch_warnings()``: before Python 3.14,
``catch_warnings`` swaps the process-wide filter list and puts it back on
exit. An async save issues this warning from DCP's background thread while
the training thread runs on, so a ``catch_warnings`` there would race with
(and, on exit, undo) filter changes the training thread makes meanwhile. The
filter added here is safe from any thread and matches only this one message,
of category ``UserWarning``, issued from a module of DCP (which one depends on
the torch release: the entry point, or the decorator around it); every other
warning, torch's included, is shown as before.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from nbtools.errors import CheckpointError, NbtoolsError

__all__ = ["unwrap", "quiet_single_process_warning", "SINGLE_PROCESS_MESSAGE", "DCP_MODULES"]

#: The message DCP issues when it runs without a process group (save or load).
SINGLE_PROCESS_MESSAGE = (
    r"torch\.distributed is disabled, unavailable or uninitialized, "
    r"assuming the intent is to (save|load) in a single process"
)
#: The modules that may issue it: DCP's own.
DCP_MODULES = r"torch\.distributed\.checkpoint(\.[\w.]+)?\Z"

_lock = threading.Lock()


def unwrap(exc: BaseException, what: str) -> BaseException:
    """The error to raise for ``exc``: the first nbtools error of any rank, else a CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures: dict[int, Any] = exc.failures
        for rank in sorted(failures):
            inner = failures[rank][0]
            if isinstance(inner, NbtoolsError):
                return inner
        rank = min(failures) if failures else -1
        inner = failures[rank][0] if failures else exc
        err = CheckpointError(f"{what} failed on rank {rank}: {type(inner).__name__}: {inner}")
        err.__cause__ = exc
        return err
    if isinstance(exc, NbtoolsError):
        return exc
    if isinstance(exc, Exception):
        err = CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err
    return exc


def _installed() -> bool:
    for action, message, category, module, _lineno in warnings.filters:
        if (
            action == "ignore"
            and category is UserWarning
            and getattr(message, "pattern", None) == SINGLE_PROCESS_MESSAGE
            and getattr(module, "pattern", None) == DCP_MODULES
        ):
            return True
    return False


def quiet_single_process_warning() -> None:
    """Ignore DCP's single-process warning from now on (idempotent; any thread)."""
    with _lock:
        if not _installed():
            warnings.filterwarnings(
                "ignore",
                message=SINGLE_PROCESS_MESSAGE,
                category=UserWarning,
                module=DCP_MODULES,
            )
