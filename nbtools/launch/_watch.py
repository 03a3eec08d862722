"""Waiting for a group of ranks: its outcome, stacks when it hangs or is interrupted.

Works on any :class:`~nbtools.launch._backend.RankGroup`; how ranks are
polled and made to print their stacks is the backend's business. While the
group runs, a :class:`nbtools.events.Watchdog` judges the ranks' progress
reports: a hang is one warning in the cell (culprits, then every rank's
stack, read from outside the processes), and with ``on_hang="restart"`` a
failure of the group, which the runner restarts. A straggler flag is one line
in the cell when it starts and one when it ends.
"""

from __future__ import annotations

import contextlib
import time

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.launch._backend import Failed, Outcome, RankGroup
from nbtools.launch._failures import RankFailure
from nbtools.launch._output import OutputForwarder

__all__ = ["watch", "interrupted_stacks", "hang_failure"]

_log = get_logger("launch")


def watch(
    group: RankGroup,
    forwarder: OutputForwarder,
    hang_timeout: float | None,
    on_hang: str = "report",
) -> Outcome:
    """Poll ``group`` until every rank returned or one failed, watching for hangs.

    Once ranks report progress, a hang is judged by it (see
    :class:`nbtools.events.Watchdog`; ``hang_timeout`` replaces the adaptive
    bound) and shown once per culprit; with ``on_hang="restart"`` it ends the
    watch as a failure of the culprits. A run that reports no progress keeps
    the plain rule: once no rank has written anything for ``hang_timeout``,
    print every rank's Python stack (once); the call keeps running.

    Raises:
        KeyboardInterrupt: the caller was interrupted (ranks still running).
    """
    with events.Watchdog(len(group.stdouts), hang_timeout=hang_timeout) as dog:
        outcome = _watch(group, forwarder, hang_timeout, on_hang, dog)
    for notice in dog.take_notices():  # flags still open ended with the group
        _log.warning("%s", notice)
    return outcome


def _watch(
    group: RankGroup,
    forwarder: OutputForwarder,
    hang_timeout: float | None,
    on_hang: str,
    dog: events.Watchdog,
) -> Outcome:
    stacks_shown = False
    while True:
        outcome = group.poll()
        if outcome is not None:
            return outcome
        for report in dog.take_reports():
            _log.warning("%s", report.text)
            if on_hang == "restart":
                return hang_failure(report)
        for notice in dog.take_notices():  # a straggler flag starts or ends
            _log.warning("%s", notice)
        if dog.reporting:
            continue
        quiet = time.monotonic() - forwarder.last_output
        if hang_timeout is not None and not stacks_shown and quiet > hang_timeout:
            stacks_shown = True
            _log.warning(
                "no rank has written any output for %.0f s (hang_timeout); the Python stack "
                "of every rank follows. The call keeps running; interrupt the kernel to stop it.",
                quiet,
            )
            group.show_stacks(lambda: forwarder.last_output)


def interrupted_stacks(group: RankGroup, forwarder: OutputForwarder) -> None:
    """On an interrupt: show where every rank was before they are stopped."""
    _log.warning("interrupted: the Python stack of every rank follows; then the ranks are stopped")
    with contextlib.suppress(KeyboardInterrupt):  # a second interrupt skips the wait
        group.show_stacks(lambda: forwarder.last_output)


def hang_failure(report: events.HangReport) -> Failed:
    """A hang as the failure of its culprits, for the runner to restart the group."""
    headline = report.text.split(" The call keeps running", 1)[0]
    failures = {
        rank: RankFailure(rank, "Hang", headline, time=report.since) for rank in report.ranks
    }
    return Failed(failures, report.ranks[0] if report.ranks else None)
