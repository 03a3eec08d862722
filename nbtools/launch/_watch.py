"""Waiting for a group of ranks: its outcome, stacks when it hangs or is interrupted.

Works on any :class:`~nbtools.launch._backend.RankGroup`; how ranks are
polled and made to print their stacks is the backend's business. While the
group runs, a :class:`nbtools._hangs.Watchdog` judges the ranks' progress
reports, and :class:`HangPolicy` decides what a hang does: one warning in the
cell (culprits, then every rank's stack, read from outside the processes), and
with ``on_hang="restart"`` a failure of the group, which the runner restarts. A
straggler flag is one line in the cell when it starts and one when it ends. A
pool's call (:mod:`nbtools.launch.pool`) follows the same policy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from nbtools import _hangs, events
from nbtools._internal.log import get_logger
from nbtools.launch._backend import Failed, Outcome, RankGroup
from nbtools.launch._failures import RankFailure
from nbtools.launch._output import OutputForwarder

__all__ = ["FirstSteps", "HangPolicy", "watch", "interrupted_stacks", "hang_failure"]

#: The first steps of a run, kept across its attempts and a pool's calls (one per run).
FirstSteps = _hangs.FirstSteps

_log = get_logger("launch")


def watch(
    group: RankGroup,
    forwarder: OutputForwarder,
    hang_timeout: float | None,
    on_hang: str = "report",
    first_steps: _hangs.FirstSteps | None = None,
    launched_at: float | None = None,
) -> Outcome:
    """Poll ``group`` until every rank returned or one failed, watching for hangs.

    Once ranks report progress, a hang is judged by it (see
    :class:`nbtools._hangs.Watchdog`; ``hang_timeout`` replaces the adaptive
    bound) and shown once per culprit; with ``on_hang="restart"`` it ends the
    watch as a failure of the culprits. A run that reports no progress keeps
    the plain rule: once no rank has written anything for ``hang_timeout``,
    print every rank's Python stack (once); the call keeps running.
    ``first_steps``, kept by the caller across a run's attempts, carries the
    start-up bound learned in one attempt to the next. ``launched_at``: when the
    group was launched (``time.monotonic``), which the start-up bound counts from.

    Raises:
        KeyboardInterrupt: the caller was interrupted (ranks still running).
    """
    with _hangs.Watchdog(
        len(group.stdouts),
        hang_timeout=hang_timeout,
        localize=forwarder.localize,
        first_steps=first_steps,
        launched_at=launched_at,
        # Ranks on other machines, looked at from their nodes when their reports stop.
        look=getattr(group, "look_at", None),
    ) as dog:
        outcome = _watch(group, forwarder, hang_timeout, on_hang, dog)
    # A hang seen just before the group ended (its report, asked of the ranks, can come after
    # the flag's event released the rank): still said, then the flags the group's end closed.
    for report in dog.take_reports():
        _log.warning("%s", report.text)
    for notice in dog.take_notices():
        _log.warning("%s", notice)
    return outcome


def _watch(
    group: RankGroup,
    forwarder: OutputForwarder,
    hang_timeout: float | None,
    on_hang: str,
    dog: _hangs.Watchdog,
) -> Outcome:
    policy = HangPolicy(on_hang, hang_timeout)
    while True:
        outcome = group.poll()
        if outcome is not None:
            return outcome
        quiet = time.monotonic() - forwarder.last_output
        failed = policy.look(dog, quiet, lambda: group.show_stacks(lambda: forwarder.last_output))
        if failed is not None:
            if _end_to_heal(group, failed):
                continue  # the group heals the ended ranks in place
            return failed


class HangPolicy:
    """What a call does on a hang: the same for ``@distributed`` and a pool's call.

    Args:
        on_hang: ``"report"`` warns in the cell and keeps waiting; ``"restart"``
            also ends the call as the failure of the hang's culprits.
        hang_timeout: for a run that reports no progress, the seconds without
            output after which every rank's Python stack is shown (once).
    """

    def __init__(self, on_hang: str, hang_timeout: float | None) -> None:
        self.on_hang = on_hang
        self.hang_timeout = hang_timeout
        self._stacks_shown = False

    def look(
        self, dog: _hangs.Watchdog | None, quiet: float, show_stacks: Callable[[], None]
    ) -> Failed | None:
        """One look while the call runs; the failure that ends it (``on_hang="restart"``), or None.

        ``dog`` judges the ranks' progress reports (None while it is not started):
        each hang report is one warning, each straggler flag's start or end one
        line. Without progress reports, ``quiet`` (seconds since any rank wrote
        output) past ``hang_timeout`` shows every rank's stack by ``show_stacks``.
        """
        if dog is not None:
            for report in dog.take_reports():
                _log.warning("%s", report.text)
                if self.on_hang == "restart":
                    return hang_failure(report)
            for notice in dog.take_notices():  # a straggler flag starts or ends
                _log.warning("%s", notice)
            if dog.reporting:
                return None
        if self.hang_timeout is not None and not self._stacks_shown and quiet > self.hang_timeout:
            self._stacks_shown = True
            _log.warning(
                "no rank has written any output for %.0f s (hang_timeout); the Python stack "
                "of every rank follows. The call keeps running; interrupt the kernel to stop it.",
                quiet,
            )
            show_stacks()
        return None


def interrupted_stacks(group: RankGroup, forwarder: OutputForwarder) -> None:
    """On an interrupt: show where every rank was before they are stopped."""
    _log.warning("interrupted: the Python stack of every rank follows; then the ranks are stopped")
    with contextlib.suppress(KeyboardInterrupt):  # a second interrupt skips the wait
        group.show_stacks(lambda: forwarder.last_output)


def _end_to_heal(group: RankGroup, failed: Failed) -> bool:
    """Where ``group`` heals dead ranks in place (``heal=True``): end the hung ranks with
    SIGKILL so that it replaces them while the others keep their processes; whether it did."""
    healer = getattr(group, "healer", None)
    ranks = sorted(failed.failures)
    if healer is None or not healer.enabled or not ranks or healer.why_not(ranks, set()):
        return False
    seen = {e.rank: e.fields.get("rank_pid") for e in events.log(kinds=["hang"]) if e.fields}
    pids = [seen.get(rank) for rank in ranks]
    if not all(isinstance(pid, int) for pid in pids):
        # A rank that hung before its first progress report reached the kernel.
        _log.warning("the hung rank's process is not known yet: not healed in place")
        return False
    _log.warning("ending the hung rank%s with SIGKILL to heal in place", "s"[: len(ranks) - 1])
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)  # type: ignore[arg-type]
    return True


def hang_failure(report: _hangs.HangReport) -> Failed:
    """A hang as the failure of its culprits, for the runner to restart the group."""
    headline = report.headline
    failures = {
        rank: RankFailure(rank, "Hang", headline, time=report.since) for rank in report.ranks
    }
    return Failed(failures, report.ranks[0] if report.ranks else None)
