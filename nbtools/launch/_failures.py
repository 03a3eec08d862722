"""What went wrong in which rank, and how it reads in the notebook."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from nbtools._internal.log import get_logger
from nbtools.launch._rank import GROUP_PHASE

__all__ = [
    "RankFailure",
    "from_record",
    "from_exit",
    "from_early_exit",
    "describe",
    "REGROUPS",
    "forms_again",
]

_log = get_logger("launch")

#: A message longer than this is cut in the text shown; the failure keeps it whole.
MESSAGE_LIMIT = 2_000
#: The same for a traceback (its end, where the error is, is kept).
TRACEBACK_LIMIT = 20_000


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure, as carried by :class:`nbtools.errors.DistributedError`.

    Attributes:
        rank: global rank that failed.
        exc_type: exception type name (``"ValueError"``, ``"mymodule.MyError"``),
            or ``"Signal"``/``"Exit"`` when the process died without raising, or
            ``"EarlyExit"`` when it ended with code 0 before its function returned.
        message: the exception's message, or how the process ended.
        traceback: the remote traceback as text ("" when the process died without one).
        exitcode: the process exit code (negative: killed by that signal), if known.
        attempt: 0 for the first try, then the restart count.
        time: when the rank reported the failure (seconds since the epoch), if known.
        phase: ``"group"`` when it happened while the process group was being
            formed (before any user code ran), else ``""``.
        collective: the ``torch.distributed`` operation the rank was in when it
            failed (``"all_reduce"``), else ``""``.
        node: where the rank ran, on a cluster (``"host (1a2b3c4d, 10.0.0.5)"``:
            host name, start of the Ray node id, IP); ``""`` on this machine.
            ``exc_type`` is ``"ActorDied"`` when the rank's process died there
            and ``"NodeLost"`` when its whole node was lost.

    ``message`` and ``traceback`` are always complete; the text of a
    ``DistributedError`` shows at most :data:`MESSAGE_LIMIT` and
    :data:`TRACEBACK_LIMIT` characters of them.
    """

    rank: int
    exc_type: str
    message: str
    traceback: str = ""
    exitcode: int | None = None
    attempt: int = 0
    time: float | None = None
    phase: str = ""
    collective: str = ""
    node: str = ""


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
        collective=str(record.get("collective", "")),
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


def from_early_exit(rank: int, attempt: int) -> RankFailure:
    """A rank that ended with exit code 0 while its function had not returned."""
    return RankFailure(rank, "EarlyExit", "exited with code 0 before returning", "", 0, attempt)


def describe(
    failures: dict[int, RankFailure],
    first: int | None = None,
    attempts: int = 1,
    returned: frozenset[int] = frozenset(),
) -> str:
    """The message of a ``DistributedError``: the first failure in full, the others in brief.

    ``first`` is the rank whose process ended first, the likely cause; ranks
    that failed after it usually lost a peer in a collective. ``returned``
    names ranks whose function had returned: a failure in a collective is then
    explained by them.
    """
    ordered = sorted(
        failures.values(),
        key=lambda f: (f.rank != first, f.time is None, f.time or 0.0, f.rank),
    )
    first = ordered[0]
    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
    gone = sorted(returned - set(failures))
    because = ""
    if first.collective and gone:
        who = ", ".join(str(r) for r in gone)
        verb = "had returned" if len(gone) > 1 else "returned"
        because = f"rank{'s' if len(gone) > 1 else ''} {who} {verb} while rank {first.rank} "
        because += f"was in {first.collective}, so "
    lines = [f"{because}{_headline(first, 'failed' + tries)}"]
    for other in ordered[1:]:
        lines.append(_headline(other, "also failed"))
    if first.traceback:
        lines += ["", f"Traceback from rank {first.rank}:", _clip_traceback(first)]
    return "\n".join(lines)


def _headline(failure: RankFailure, verb: str) -> str:
    who = f"rank {failure.rank}" + (f" on {failure.node}" if failure.node else "")
    if failure.exc_type == "EarlyExit":
        return f"{who} {failure.message}{verb[len('failed') :]}".rstrip()
    return f"{who} {verb}: {_summary(failure)}"


#: Failures that are how a process ended, not an exception: the message says it all.
_ENDINGS = ("Signal", "Exit", "EarlyExit", "ActorDied", "NodeLost")


def _summary(failure: RankFailure) -> str:
    message = _clip(failure.message, MESSAGE_LIMIT, failure.rank, "message")
    if failure.exc_type in _ENDINGS:
        return message
    return f"{failure.exc_type}: {message}" if message else failure.exc_type


def _clip(text: str, limit: int, rank: int, field: str) -> str:
    if len(text) <= limit:
        return text
    return (
        f"{text[:limit]} [... {len(text) - limit:,} more characters; the whole text is "
        f"in DistributedError.failures[{rank}].{field}]"
    )


def _clip_traceback(failure: RankFailure) -> str:
    text = failure.traceback.rstrip()
    lines = [_clip(line, MESSAGE_LIMIT, failure.rank, "traceback") for line in text.splitlines()]
    text = "\n".join(lines)
    if len(text) <= TRACEBACK_LIMIT:
        return text
    cut = len(text) - TRACEBACK_LIMIT
    return (
        f"[... {cut:,} characters cut; the whole traceback is in "
        f"DistributedError.failures[{failure.rank}].traceback]\n{text[cut:]}"
    )


#: Times a group that failed to form is formed again before its failure counts.
REGROUPS = 2


def forms_again(cause: RankFailure | None, regroups: int) -> bool:
    """Whether ranks whose group failed to form are simply started again (and says so).

    gloo occasionally fails to connect on a busy host. No user code has run
    then, so forming the group again is invisible to the user; after
    :data:`REGROUPS` tries the failure is reported like any other.
    """
    if cause is None or cause.phase != GROUP_PHASE or regroups >= REGROUPS:
        return False
    _log.info("the process group did not form (%s); forming it again", cause.message)
    return True
