"""What went wrong in which rank, and how it reads in the notebook."""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["RankFailure", "from_record", "from_exit", "describe"]


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure, as carried by :class:`nbtools.errors.DistributedError`.

    Attributes:
        rank: global rank that failed.
        exc_type: exception type name (``"ValueError"``, ``"mymodule.MyError"``),
            or ``"Signal"``/``"Exit"`` when the process died without raising.
        message: the exception's message, or how the process ended.
        traceback: the remote traceback as text ("" when the process died without one).
        exitcode: the process exit code (negative: killed by that signal), if known.
        attempt: 0 for the first try, then the restart count.
        time: when the rank reported the failure (seconds since the epoch), if known.
        phase: ``"group"`` when it happened while the process group was being
            formed (before any user code ran), else ``""``.
    """

    rank: int
    exc_type: str
    message: str
    traceback: str = ""
    exitcode: int | None = None
    attempt: int = 0
    time: float | None = None
    phase: str = ""


def from_record(record: dict, attempt: int) -> RankFailure:
    """A failure from the JSON record a rank published before exiting."""
    return RankFailure(
        rank=int(record["rank"]),
        exc_type=str(record["exc_type"]),
        message=str(record["message"]),
        traceback=str(record.get("traceback", "")),
        exitcode=1,
        attempt=attempt,
        time=record.get("time"),
        phase=str(record.get("phase", "")),
    )


def from_exit(rank: int, exitcode: int | None, attempt: int) -> RankFailure:
    """A failure of a rank that ended without a record (killed, or ``os._exit``)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return RankFailure(
            rank, "Signal", f"the process was killed by {name}", "", exitcode, attempt
        )
    return RankFailure(
        rank,
        "Exit",
        f"the process exited with code {exitcode} without raising an exception",
        "",
        exitcode,
        attempt,
    )


def describe(failures: dict[int, RankFailure], first: int | None = None, attempts: int = 1) -> str:
    """The message of a ``DistributedError``: the first failure in full, the others in brief.

    ``first`` is the rank whose process ended first, the likely cause; ranks
    that failed after it usually lost a peer in a collective.
    """
    ordered = sorted(
        failures.values(),
        key=lambda f: (f.rank != first, f.time is None, f.time or 0.0, f.rank),
    )
    first = ordered[0]
    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
    lines = [f"rank {first.rank} failed{tries}: {_summary(first)}"]
    for other in ordered[1:]:
        lines.append(f"rank {other.rank} also failed: {_summary(other)}")
    if first.traceback:
        lines += ["", f"Traceback from rank {first.rank}:", first.traceback.rstrip()]
    return "\n".join(lines)


def _summary(failure: RankFailure) -> str:
    if failure.exc_type in ("Signal", "Exit"):
        return failure.message
    return f"{failure.exc_type}: {failure.message}" if failure.message else failure.exc_type
