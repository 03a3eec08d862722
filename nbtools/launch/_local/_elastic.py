"""torch elastic's process context for one attempt: starting it, its exit status, quiet loggers.

``start`` is what ``torch.distributed.elastic.multiprocessing.start_processes``
does for a function entry point, except that an interrupt during the start also
stops what has already started; ``exit_status`` waits briefly for torch to
collect a rank that vanished; ``ElasticQuiet`` silences torch's per-process
reports while :mod:`nbtools.launch._local` reports the attempt as one error.
"""

from __future__ import annotations

import logging
import pickle
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
from nbtools.launch._rank import run_rank

__all__ = ["POLL_S", "STOP_GRACE_S", "ElasticQuiet", "exit_status", "start"]

POLL_S = 0.005
# Grace between SIGTERM and SIGKILL when ranks are stopped (must stay well under 5 s).
STOP_GRACE_S = 2
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
