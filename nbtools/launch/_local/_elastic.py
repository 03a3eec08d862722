"""torch elastic's process context for one attempt: starting it, its exit status, quiet loggers.

Also what the local group reads of a rank's process from outside: whether it handles a
signal (``catches``), and whether a silent end was for want of disk (``with_full_disk``).

``start`` is what ``torch.distributed.elastic.multiprocessing.start_processes``
does for a function entry point, except that an interrupt during the start also
stops what has already started; ``exit_status`` waits briefly for torch to
collect a rank that vanished; ``ElasticQuiet`` silences torch's per-process
reports while :mod:`nbtools.launch._local` reports the attempt as one error.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import shutil
import signal
import time

from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SignalException,
)

from nbtools.errors import LaunchError
from nbtools.launch import _env
from nbtools.launch._failures import RankFailure
from nbtools.launch._rank import run_rank

__all__ = [
    "POLL_S",
    "STOP_GRACE_S",
    "ElasticQuiet",
    "catches",
    "exit_status",
    "start",
    "with_full_disk",
]

POLL_S = 0.005
# Grace between SIGTERM and SIGKILL when ranks are stopped (must stay well under 5 s).
STOP_GRACE_S = 2
# Under this much free space, a rank that left no failure record is taken to have had no room.
_FULL_DISK_BYTES = 1024 * 1024
# How long a rank that vanished may take to have its exit status reach torch.
_EXIT_STATUS_WAIT_S = 1.0
# torch's elastic loggers report every closed process; the caller gets one DistributedError instead.
_ELASTIC_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


def start(
    args: dict, envs: dict, logs: DefaultLogsSpecs, start_method: str = _env.START_METHOD
) -> PContext:
    # What ``start_processes`` does for a function entry point, except that an
    # interrupt during the start also stops what has already started.
    ctx = MultiprocessContext(
        name="nbtools",
        entrypoint=run_rank,
        args=args,
        envs=envs,
        logs_specs=logs,
        start_method=start_method,
    )
    try:
        with _env.main_module_hidden(), _env.signal_handlers_kept():
            ctx.start()
    except BaseException as exc:
        try:
            ctx.close(signal.SIGTERM, timeout=STOP_GRACE_S)
        except KeyboardInterrupt:
            ctx.close(signal.SIGKILL, timeout=STOP_GRACE_S)
        if isinstance(exc, SignalException):
            raise KeyboardInterrupt from exc
        if isinstance(exc, (OSError, pickle.PicklingError, RuntimeError)):
            raise LaunchError(f"the ranks could not be started: {exc}") from exc
        raise
    return ctx


def exit_status(ctx: PContext) -> RunProcsResult | None:
    """torch's failure result if the vanished rank exited non-zero; None for exit code 0."""
    deadline = time.monotonic() + _EXIT_STATUS_WAIT_S
    while time.monotonic() < deadline:
        result = ctx.wait(0)
        if result is not None:
            return result
        time.sleep(POLL_S * 4)
    return None


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


class ElasticQuiet:
    """Silences torch's elastic loggers from the start of an attempt until :meth:`close`."""

    def __init__(self) -> None:
        self._dropper = _DropRecords()
        self._loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
        for logger in self._loggers:
            logger.addFilter(self._dropper)

    def close(self) -> None:
        for logger in self._loggers:
            logger.removeFilter(self._dropper)
        self._loggers = []


def with_full_disk(failure: RankFailure, attempt_dir: str) -> RankFailure:
    """``failure`` of a rank that left no record, saying so when its directory is full.

    A rank whose failure record cannot be written (a full ``TMPDIR``) would otherwise
    read as an unexplained exit.
    """
    if failure.exitcode is not None and failure.exitcode < 0:
        return failure  # killed by a signal: not for want of space
    try:
        free = shutil.disk_usage(attempt_dir).free
    except OSError:
        return failure
    if free >= _FULL_DISK_BYTES:
        return failure
    return dataclasses.replace(
        failure,
        message=f"{failure.message}; its launch directory {attempt_dir} is full ({free} bytes "
        "free), so it could not report why: free space in TMPDIR",
    )


def catches(pid: int, sig: int) -> bool:
    """Whether the process ``pid`` has a handler for ``sig`` (its ``SigCgt`` mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
