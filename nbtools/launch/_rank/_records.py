"""What a rank sends back besides its result: its failure record and its buffered events.

The failure record is plain JSON-able data: local ranks publish it as a file;
Ray ranks return it from their actor call. The caller turns it into a
:class:`~nbtools.launch._failures.RankFailure`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from types import TracebackType

__all__ = ["failure_record", "flush_events", "GROUP_PHASE"]

#: Phase of a failure while the process group was being formed (before any user code ran).
GROUP_PHASE = "group"


def failure_record(rank: int, exc: BaseException, *, phase: str = "", skip_file: str = "") -> dict:
    """What rank ``rank`` reports about ``exc``.

    Args:
        rank: the global rank.
        exc: the exception that ended the rank's function.
        phase: ``"group"`` while the process group was being formed, else ``""``.
        skip_file: leading traceback frames from this file (the launcher's own)
            are dropped, so the remote traceback starts in user code.
    """
    tb = exc.__traceback__
    while tb is not None and skip_file and tb.tb_frame.f_code.co_filename == skip_file:
        tb = tb.tb_next
    exc_type = type(exc)
    name = exc_type.__qualname__
    if exc_type.__module__ not in ("builtins", "__main__"):
        name = f"{exc_type.__module__}.{name}"
    return {
        "rank": rank,
        "exc_type": name,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
        "time": time.time(),
        "phase": phase,
        "collective": _collective(exc.__traceback__),
    }


def _collective(tb: TracebackType | None) -> str:
    """Name of the ``torch.distributed`` operation the exception came out of ("" if none)."""
    name = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
            name = code.co_name
        tb = tb.tb_next
    return name.lstrip("_")


def flush_events() -> None:
    """Send the rank's buffered events to the caller before it reads a result or failure."""
    emit = sys.modules.get("nbtools.events._emit")
    if emit is not None:
        try:
            emit.flush()
        except Exception:  # noqa: BLE001 - events never turn a result into a failure
            pass
