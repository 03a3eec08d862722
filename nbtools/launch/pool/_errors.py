"""How a pool call's failures read in the notebook: which error, which rank leads.

Every rank answered, some with an exception: the answers become
:class:`~nbtools.launch.RankFailure` records (tracebacks rewritten to show the
notebook's source) and one error. Bad input reads as one line: a name missing
on the ranks is a ``NameError``, a value that cannot travel a ``PicklingError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nbtools.errors import DistributedError, PicklingError
from nbtools.launch._failures import RankFailure, describe, from_record
from nbtools.launch.pool._rank import OK

__all__ = ["rank_errors", "failures_of", "first", "plural", "ranks_text"]


def rank_errors(op: str, failures: dict[int, RankFailure]) -> Exception:
    """The error for a call that every rank answered, some with an exception."""
    kinds = {f.exc_type for f in failures.values()}
    if op == "pull" and kinds == {"NameError"}:
        missing = failures[min(failures)].message  # the names, quoted
        verb = "are" if "," in missing else "is"
        return NameError(
            f"{missing} {verb} not defined on rank{plural(failures)} {ranks_text(failures)} of the "
            "pool; create it there with pool.execute / %%distributed, or pool.push it"
        )
    if all(kind.endswith("_Unpicklable") for kind in kinds):
        lead = failures[min(failures)]
        return PicklingError(f"rank {lead.rank}: {lead.message}. Pull plain data instead.")
    message = describe(failures, first(failures))
    return DistributedError(
        f"{message}\n\nEvery rank is idle again; the pool and its state were kept.", failures
    )


def failures_of(
    replies: dict[int, tuple[str, Any]], attempt: int, localize: Callable[[str], str]
) -> dict[int, RankFailure]:
    """The failures among the ranks' answers, tracebacks rewritten for the notebook."""
    failures = {}
    for rank, (kind, data) in replies.items():
        if kind == OK:
            continue
        failure = from_record(data, attempt)
        if failure.traceback:
            failure = _with_traceback(failure, localize(failure.traceback))
        failures[rank] = failure
    return failures


def first(failures: dict[int, RankFailure]) -> int | None:
    """The failure to show in full: the earliest, or rank 0's when every rank raised alike."""
    if not failures:
        return None
    if len({f.exc_type for f in failures.values()}) == 1:
        return min(failures)
    return min(failures.values(), key=lambda f: f.time or 0.0).rank


def _with_traceback(failure: RankFailure, traceback: str) -> RankFailure:
    return dataclasses.replace(failure, traceback=traceback)


def plural(items: Any) -> str:
    return "s" if len(items) > 1 else ""


def ranks_text(items: Any) -> str:
    return ", ".join(str(r) for r in sorted(items))
