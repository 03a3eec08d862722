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
import json
import logging
import os
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
from nbtools.launch._backend import Failed, GroupSpec
from nbtools.launch._failures import RankFailure, from_early_exit, from_exit, from_record
from nbtools.launch._rank import failure_path, returned_path, run_rank

__all__ = [
    "POLL_S",
    "STOP_GRACE_S",
    "ElasticQuiet",
    "catches",
    "failed",
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


def failed(
    spec: GroupSpec,
    result: RunProcsResult | None,
    early: int | None,
    exited: dict[int, int],
    first: int | None = None,
) -> Failed:
    """How group ``spec``'s attempt failed: from torch's ``result``, or, where it has none,
    from ``early`` (a rank gone without a known exit code) or the ranks' ``exited`` codes
    and the rank seen to end ``first``; each rank's own failure record first."""
    attempt_dir, attempt = spec.attempt_dir, spec.restart_count
    world = spec.world_size
    returned = frozenset(r for r in range(world) if os.path.exists(returned_path(attempt_dir, r)))
    failures: dict[int, RankFailure] = {}
    for rank in range(world):
        path = failure_path(attempt_dir, rank)
        if os.path.exists(path):
            with open(path) as fh:
                failures[rank] = from_record(json.load(fh), attempt)
    if early is not None:
        # Gone before torch reported it (a busy host): its own record, else its exit
        # code, says how; "exited with code 0" only when that is what happened.
        if early not in failures:
            code = exited.get(early)
            failures[early] = with_full_disk(
                from_exit(early, code, attempt) if code else from_early_exit(early, attempt),
                attempt_dir,
            )
        return Failed(failures, early, returned)
    if result is not None:
        codes = {r: f.exitcode for r, f in result.failures.items()}
    else:
        codes = {first: exited[first]} if first in exited else {}
    reported = sorted(r for r in codes if r not in failures)
    # Ranks torch did not report (it names one): they died before the stop, unless
    # the caller stopped the group itself, and then torch's report comes first.
    # torch's own wait also stops the others (SIGTERM) once it sees one fail: a rank
    # ended so without a record of its own was stopped, and is not a cause.
    others = sorted(
        r
        for r in exited
        if r not in returned
        and r not in failures
        and r not in codes
        and exited[r] != -signal.SIGTERM
    )
    codes.update((r, exited[r]) for r in others)
    silent = reported + others
    if silent:
        # Died without raising (a signal, os._exit): that is what the others reacted
        # to, even when a peer's error in the collective was recorded (or reported
        # by torch) first.
        for rank in silent:
            failures[rank] = with_full_disk(from_exit(rank, codes[rank], attempt), attempt_dir)
        return Failed(failures, silent[0], returned)
    # Every rank that raised wrote a record; the earliest one is the cause, since
    # peers of a failed rank fail later, in the collective they were waiting in.
    first = min(failures.values(), key=lambda f: f.time or 0.0).rank if failures else None
    return Failed(failures, first, returned)
