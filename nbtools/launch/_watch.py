"""Waiting for a group of ranks: its outcome, stacks when it hangs or is interrupted.

Works on any :class:`~nbtools.launch._backend.RankGroup`; how ranks are
polled and made to print their stacks is the backend's business.
"""

from __future__ import annotations

import contextlib
import time

from nbtools._internal.log import get_logger
from nbtools.launch._backend import Outcome, RankGroup
from nbtools.launch._output import OutputForwarder

__all__ = ["watch", "interrupted_stacks"]

_log = get_logger("launch")


def watch(group: RankGroup, forwarder: OutputForwarder, hang_timeout: float | None) -> Outcome:
    """Poll ``group`` until every rank returned or one failed.

    With ``hang_timeout``: once no rank has written anything for that long,
    print every rank's Python stack (once); the call keeps running.

    Raises:
        KeyboardInterrupt: the caller was interrupted (ranks still running).
    """
    stacks_shown = False
    while True:
        outcome = group.poll()
        if outcome is not None:
            return outcome
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
