"""The local launch backend: ranks on this machine, started by torch's elastic machinery.

Each attempt is one ``PContext`` of ``torch.distributed.elastic.multiprocessing``
(forkserver start method). Rendezvous is a ``FileStore`` in the attempt's
private directory: nothing listens on a port for it, and gloo/nccl are pinned
to the loopback interface. Ranks publish failure records, "returned" marks and
the processes they left running as files in the attempt directory
(:mod:`nbtools.launch._worker`); :meth:`LocalGroup.poll` reads them.

A rank that failed makes the context stop the others at once instead of
leaving them in a collective; what ranks leave running is ended by them or,
after a failure or an interrupt, here (:mod:`nbtools.launch._leftovers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SignalException,
    Std,
)

from nbtools import _torch_compat
from nbtools.errors import LaunchError
from nbtools.launch import _env, _leftovers, _results
from nbtools.launch._backend import Failed, Finished, GroupSpec, Outcome, wait_for_stacks
from nbtools.launch._failures import RankFailure, from_early_exit, from_exit, from_record
from nbtools.launch._worker import (
    STACK_SIGNAL,
    RankSpec,
    failure_path,
    leftovers_path,
    release_path,
    returned_path,
    run_rank,
)

__all__ = ["LocalBackend", "LocalGroup"]

_POLL_S = 0.005
# Grace between SIGTERM and SIGKILL when ranks are stopped (must stay well under 5 s).
_STOP_GRACE_S = 2
# How long a rank that vanished may take to have its exit status reach torch.
_EXIT_STATUS_WAIT_S = 1.0
# Under this much free space, a rank that left no failure record is taken to have had no room.
_FULL_DISK_BYTES = 1024 * 1024
# Stacks are written by the ranks' signal handlers; wait for them to reach the cell.
# torch's elastic loggers report every closed process; the caller gets one DistributedError instead.
_ELASTIC_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


class LocalBackend:
    """Starts ranks on this machine from the forkserver (see the module docstring)."""

    name = "local"
    remote_nodes = False
    interrupts_blocked_calls = True

    def gpu_count(self) -> int:
        """GPUs torch sees on this machine."""
        return _env.visible_gpu_count()

    def check(self, world_size: int, use_cuda: bool) -> None:
        """Start the forkserver if needed (GPU counts are checked by the caller's plan)."""
        _env.warm_up()

    def start(self, spec: GroupSpec) -> LocalGroup:
        """Start the ranks of one attempt."""
        _env.warm_up()
        base = _env.caller_environment()
        base.update(spec.env)
        port = _env.free_port()
        interface = _env.loopback_interface()
        envs, args = {}, {}
        for rank in range(spec.world_size):
            envs[rank] = _env.rank_environment(
                base,
                rank=rank,
                world_size=spec.world_size,
                run_id=spec.run_id,
                restart_count=spec.restart_count,
                max_restarts=spec.max_restarts,
                master_port=port,
                interface=interface,
                use_cuda=spec.use_cuda,
            )
            rank_spec = RankSpec(
                rank=rank,
                world_size=spec.world_size,
                backend=spec.backend,
                use_cuda=spec.use_cuda,
                init_method="file://" + os.path.join(spec.attempt_dir, "store"),
                run_dir=spec.attempt_dir,
                caller_pid=os.getpid(),
                env_names=frozenset(envs[rank]),
            )
            args[rank] = (spec.payload, rank_spec)
        logs = DefaultLogsSpecs(log_dir=os.path.join(spec.attempt_dir, "logs"), redirects=Std.ALL)
        quiet = _ElasticQuiet()
        try:
            ctx = _start(args, envs, logs)
        except BaseException:
            quiet.close()
            raise
        return LocalGroup(ctx, spec, quiet)

    def close(self) -> None:
        """Nothing is held between attempts."""


@dataclass(frozen=True)
class _Vanished:
    """A rank that ended without returning, and torch's report of the group where it has one.

    ``report`` is ``None`` when torch has not seen the end yet (a busy host):
    the launcher then goes by the rank's own record or exit code.
    """

    rank: int
    report: RunProcsResult | None


class LocalGroup:
    """One attempt's ranks; implements :class:`~nbtools.launch._backend.RankGroup`."""

    def __init__(self, ctx: PContext, spec: GroupSpec, quiet: _ElasticQuiet) -> None:
        self._ctx = ctx
        self._spec = spec
        self._quiet = quiet
        self.stdouts: dict[int, str] = ctx.stdouts
        self.stderrs: dict[int, str] = ctx.stderrs
        self._procs = {rank: _process(pid) for rank, pid in ctx.pids().items()}
        self._groups = list(ctx.pids().values())  # each rank leads its own process group
        self._released = False
        self._stopped = False
        self._closed = False
        self._outcome: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self._outcome is not None:
            return self._outcome
        try:
            result = self._ctx.wait(0)
            early = None
            if result is None:
                gone = self._vanished()
                if gone is None:
                    time.sleep(_POLL_S)
                    return None
                if gone.report is not None:
                    result = gone.report
                else:
                    early = gone.rank
        except SignalException as exc:
            raise KeyboardInterrupt from exc
        if early is None and not result.is_failed():
            self._groups = []  # ranks that returned ended their own leftovers
            world = self._spec.world_size
            self._outcome = Finished([self._result(r) for r in range(world)])
            return self._outcome
        # Before stopping the others: which ranks had already ended, and how.
        exited = {r: c for r, c in _torch_compat.process_exitcodes(self._ctx).items() if c}
        self.stop()
        self._outcome = self._failed(result, early, exited)
        return self._outcome

    def _result(self, rank: int) -> _results.Framed:
        """The return value rank ``rank`` left in its result file, read once."""
        return _results.load(_results.result_path(self._spec.attempt_dir, rank))

    def _vanished(self) -> _Vanished | None:
        """Release ranks once all returned; say which rank is gone before returning, if any."""
        attempt_dir = self._spec.attempt_dir
        returned = {r for r in self._procs if os.path.exists(returned_path(attempt_dir, r))}
        if not self._released and len(returned) == len(self._procs):
            # Every rank has returned: they may now end what they left running.
            with open(release_path(attempt_dir), "w"):
                pass
            self._released = True
        for rank, proc in self._procs.items():
            if rank not in returned and not _running(proc):
                return _Vanished(rank, _exit_status(self._ctx))
        return None

    def _failed(self, result, early: int | None, exited: dict[int, int]) -> Failed:
        attempt_dir, attempt = self._spec.attempt_dir, self._spec.restart_count
        world = self._spec.world_size
        returned = frozenset(
            r for r in range(world) if os.path.exists(returned_path(attempt_dir, r))
        )
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
                failures[early] = _with_full_disk(
                    from_exit(early, code, attempt) if code else from_early_exit(early, attempt),
                    attempt_dir,
                )
            return Failed(failures, early, returned)
        codes = {r: f.exitcode for r, f in result.failures.items()}
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
                failures[rank] = _with_full_disk(from_exit(rank, codes[rank], attempt), attempt_dir)
            return Failed(failures, silent[0], returned)
        # Every rank that raised wrote a record; the earliest one is the cause, since
        # peers of a failed rank fail later, in the collective they were waiting in.
        first = min(failures.values(), key=lambda f: f.time or 0.0).rank if failures else None
        return Failed(failures, first, returned)

    def show_stacks(self, last_output: Callable[[], float]) -> None:
        sent = False
        for proc in self._procs.values():
            if _running(proc):
                with contextlib.suppress(psutil.Error, OSError):
                    proc.send_signal(STACK_SIGNAL)
                    sent = True
        if not sent:
            return
        start = time.monotonic()
        wait_for_stacks(last_output, start, _POLL_S * 10)

    def stop(self) -> None:
        """SIGTERM every rank, then SIGKILL after a short grace; a second interrupt hurries it."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._ctx.close(signal.SIGTERM, timeout=_STOP_GRACE_S)
        except KeyboardInterrupt:
            self._ctx.close(signal.SIGKILL, timeout=_STOP_GRACE_S)
            raise

    def close(self) -> dict[int, list[str]]:
        if self._closed:
            return {}
        self._closed = True
        try:
            if self._outcome is None:
                self.stop()
            left: dict[int, list[str]] = {}
            for rank in range(self._spec.world_size):
                path = leftovers_path(self._spec.attempt_dir, rank)
                if os.path.exists(path):
                    with open(path) as fh:
                        left[rank] = json.load(fh)
            # Only after a failure or an interrupt is anything left in the ranks' groups.
            stray = _leftovers.end_groups(self._groups)
            if stray:
                left.setdefault(-1, []).extend(stray)
            return left
        finally:
            self._quiet.close()


def _with_full_disk(failure: RankFailure, attempt_dir: str) -> RankFailure:
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


def _start(args: dict, envs: dict, logs: DefaultLogsSpecs) -> PContext:
    # What ``start_processes`` does for a function entry point, except that an
    # interrupt during the start also stops what has already started.
    ctx = MultiprocessContext(
        name="nbtools",
        entrypoint=run_rank,
        args=args,
        envs=envs,
        logs_specs=logs,
        start_method=_env.START_METHOD,
    )
    try:
        with _env.main_module_hidden(), _env.signal_handlers_kept():
            ctx.start()
    except BaseException as exc:
        try:
            ctx.close(signal.SIGTERM, timeout=_STOP_GRACE_S)
        except KeyboardInterrupt:
            ctx.close(signal.SIGKILL, timeout=_STOP_GRACE_S)
        if isinstance(exc, SignalException):
            raise KeyboardInterrupt from exc
        if isinstance(exc, (OSError, pickle.PicklingError, RuntimeError)):
            raise LaunchError(f"the ranks could not be started: {exc}") from exc
        raise
    return ctx


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


def _exit_status(ctx: PContext) -> RunProcsResult | None:
    """torch's failure result if the vanished rank exited non-zero; None for exit code 0."""
    deadline = time.monotonic() + _EXIT_STATUS_WAIT_S
    while time.monotonic() < deadline:
        result = ctx.wait(0)
        if result is not None:
            return result
        time.sleep(_POLL_S * 4)
    return None


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


class _ElasticQuiet:
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
