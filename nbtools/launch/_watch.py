"""Watching the ranks of one attempt until they all return, one fails, or the caller stops.

Besides what torch's ``PContext.wait`` reports (every rank returned, or one
exited non-zero), the watch notices:

- a rank that ended with exit code 0 without returning (``os._exit(0)``),
  which torch counts as a success while its peers keep waiting for it;
- the moment every rank has returned, when the ranks may end what they left
  running (see :mod:`nbtools.launch._leftovers`);
- a call that has printed nothing for ``hang_timeout`` seconds, and an
  interrupt: both show every rank's Python stack (``faulthandler`` in the
  ranks, triggered by :data:`STACK_SIGNAL`) before anything else happens.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil
from torch.distributed.elastic.multiprocessing import PContext, SignalException

from nbtools._internal.log import get_logger
from nbtools.launch._output import OutputForwarder
from nbtools.launch._worker import STACK_SIGNAL, release_path, returned_path

__all__ = ["EarlyExit", "watch", "show_stacks", "interrupted_stacks"]

_log = get_logger("launch")
_POLL_S = 0.005
# How long a rank that vanished may take to have its exit status reach torch.
_EXIT_STATUS_WAIT_S = 1.0
# Stacks are written by the ranks' signal handlers; wait for them to reach the cell.
_STACKS_QUIET_S = 0.3
_STACKS_LIMIT_S = 3.0


@dataclass(frozen=True)
class EarlyExit:
    """A rank that ended with exit code 0 before its function returned."""

    rank: int


def watch(
    ctx: PContext,
    forwarder: OutputForwarder,
    attempt_dir: str,
    hang_timeout: float | None,
):
    """Wait for the attempt's outcome: torch's ``RunProcsResult`` or an :class:`EarlyExit`.

    Raises:
        KeyboardInterrupt: the caller was interrupted (ranks still running).
    """
    procs = {rank: _process(pid) for rank, pid in ctx.pids().items()}
    released = False
    stacks_shown = False
    try:
        while True:
            result = ctx.wait(0)
            if result is not None:
                return result
            returned = {r for r in procs if os.path.exists(returned_path(attempt_dir, r))}
            if not released and len(returned) == len(procs):
                # Every rank has returned: they may now end what they left running.
                with open(release_path(attempt_dir), "w"):
                    pass
                released = True
            for rank, proc in procs.items():
                if rank not in returned and not _running(proc):
                    outcome = _exit_status(ctx)
                    return outcome if outcome is not None else EarlyExit(rank)
            quiet = time.monotonic() - forwarder.last_output
            if hang_timeout is not None and not stacks_shown and quiet > hang_timeout:
                stacks_shown = True
                _log.warning(
                    "no rank has written any output for %.0f s (hang_timeout); the Python stack "
                    "of every rank follows. The call keeps running; interrupt the kernel to stop it.",
                    quiet,
                )
                show_stacks(procs.values(), forwarder)
            time.sleep(_POLL_S)
    except SignalException as exc:
        raise KeyboardInterrupt from exc


def show_stacks(procs, forwarder: OutputForwarder) -> None:
    """Make every running rank print its Python stacks, and wait until they are forwarded."""
    sent = False
    for proc in procs:
        if _running(proc):
            with contextlib.suppress(psutil.Error, OSError):
                proc.send_signal(STACK_SIGNAL)
                sent = True
    if not sent:
        return
    start = time.monotonic()
    while time.monotonic() - start < _STACKS_LIMIT_S:
        time.sleep(_POLL_S * 10)
        seen = forwarder.last_output
        if seen > start and time.monotonic() - seen > _STACKS_QUIET_S:
            return


def interrupted_stacks(ctx: PContext, forwarder: OutputForwarder) -> None:
    """On an interrupt: show where every rank was before they are stopped."""
    try:
        procs = [_process(pid) for pid in ctx.pids().values()]
    except (AttributeError, RuntimeError, AssertionError):
        return  # the ranks never started
    _log.warning("interrupted: the Python stack of every rank follows; then the ranks are stopped")
    with contextlib.suppress(KeyboardInterrupt):  # a second interrupt skips the wait
        show_stacks(procs, forwarder)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _running(proc: psutil.Process | None) -> bool:
    if proc is None:
        return False
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exit_status(ctx: PContext):
    """torch's failure result if the vanished rank exited non-zero; None for exit code 0."""
    deadline = time.monotonic() + _EXIT_STATUS_WAIT_S
    while time.monotonic() < deadline:
        result = ctx.wait(0)
        if result is not None:
            return result
        time.sleep(_POLL_S * 4)
    return None

