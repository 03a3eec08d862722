"""Starting the ranks with torch's elastic machinery, watching them, restarting the group.

Each attempt is one ``PContext`` of ``torch.distributed.elastic.multiprocessing``
(forkserver start method). The caller polls it: all ranks returned, or one
failed, in which case the context stops the others at once instead of leaving
them in a collective.
A failed attempt is retried with the whole group, up to ``max_restarts`` times,
with ``TORCHELASTIC_RESTART_COUNT`` counting the attempts as torchrun does.

Rendezvous is a ``FileStore`` in a private temporary directory: nothing listens
on a port for it, and gloo/nccl are pinned to the loopback interface.

Starting, watching (:mod:`nbtools.launch._watch`) and stopping ranks happen
here and nowhere else; what the ranks leave running is ended by them or, after
a failure or an interrupt, here (:mod:`nbtools.launch._leftovers`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    MultiprocessContext,
    PContext,
    SignalException,
    Std,
)

from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError, LaunchError
from nbtools.launch import _env, _leftovers, _watch
from nbtools.launch._failures import (
    RankFailure,
    describe,
    from_early_exit,
    from_exit,
    from_record,
)
from nbtools.launch._output import OutputForwarder
from nbtools.launch._worker import (
    GROUP_PHASE,
    RankSpec,
    failure_path,
    leftovers_path,
    returned_path,
    run_rank,
)

__all__ = ["Plan", "run"]

_log = get_logger("launch")
# Times a group that failed to form is formed again before the failure counts.
_REGROUPS = 2
# Grace between SIGTERM and SIGKILL when the caller is interrupted (must stay well under 5 s).
_INTERRUPT_GRACE_S = 2
# torch's elastic loggers report every closed process; the caller gets one DistributedError instead.
_ELASTIC_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


@dataclass(frozen=True)
class Plan:
    """What to launch: how many ranks, on which device, how often to retry."""

    world_size: int
    use_cuda: bool
    max_restarts: int
    output: str
    hang_timeout: float | None = None

    @property
    def backend(self) -> str:
        return "cpu:gloo,cuda:nccl" if self.use_cuda else "gloo"


def run(
    payload: bytes, plan: Plan, localize: Callable[[str], str] = lambda text: text
) -> list[bytes]:
    """Run the payload on ``plan.world_size`` ranks; return each rank's pickled result.

    Raises:
        DistributedError: a rank failed in the last allowed attempt.
        KeyboardInterrupt: the caller was interrupted; every rank has been stopped.
    """
    _env.warm_up()
    run_dir = tempfile.mkdtemp(prefix="nbtools-launch-")
    run_id = uuid.uuid4().hex[:12]
    logs = DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.ALL)
    restarts = regroups = 0
    try:
        for index in itertools.count():
            outcome = _attempt(payload, plan, run_dir, run_id, index, restarts, logs, localize)
            if isinstance(outcome, list):
                return outcome
            failures, first, returned = outcome
            cause = failures[first]
            if cause.phase == GROUP_PHASE and regroups < _REGROUPS:
                # gloo occasionally fails to connect on a busy host; no user code
                # has run yet, so forming the group again is invisible to the user.
                regroups += 1
                _log.info("the process group did not form (%s); forming it again", cause.message)
                continue
            if restarts >= plan.max_restarts:
                break
            restarts += 1
            _log.warning(
                "%s; restarting all %d ranks (restart %d of %d)",
                describe(failures, first, returned=returned).splitlines()[0],
                plan.world_size,
                restarts,
                plan.max_restarts,
            )
        message = describe(failures, first, attempts=plan.max_restarts + 1, returned=returned)
        raise DistributedError(message, failures)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _attempt(
    payload: bytes,
    plan: Plan,
    run_dir: str,
    run_id: str,
    index: int,
    attempt: int,
    logs: DefaultLogsSpecs,
    localize: Callable[[str], str],
) -> list[bytes] | tuple[dict[int, RankFailure], int | None, frozenset[int]]:
    attempt_dir = os.path.join(run_dir, f"attempt{index}")
    os.mkdir(attempt_dir)
    base = _env.caller_environment()
    port = _env.free_port()
    interface = _env.loopback_interface()
    envs, args = {}, {}
    for rank in range(plan.world_size):
        envs[rank] = _env.rank_environment(
            base,
            rank=rank,
            world_size=plan.world_size,
            run_id=run_id,
            restart_count=attempt,
            max_restarts=plan.max_restarts,
            master_port=port,
            interface=interface,
            use_cuda=plan.use_cuda,
        )
        spec = RankSpec(
            rank=rank,
            world_size=plan.world_size,
            backend=plan.backend,
            use_cuda=plan.use_cuda,
            init_method="file://" + os.path.join(attempt_dir, "store"),
            run_dir=attempt_dir,
            caller_pid=os.getpid(),
            env_names=frozenset(envs[rank]),
        )
        args[rank] = (payload, spec)
    with _elastic_quiet():
        ctx = _start(args, envs, logs)
        forwarder = OutputForwarder(ctx.stdouts, ctx.stderrs, plan.output, sys.stdout, sys.stderr)
        forwarder.start()
        groups = list(ctx.pids().values())  # each rank leads its own process group
        try:
            result = _watch.watch(ctx, forwarder, attempt_dir, plan.hang_timeout)
            if isinstance(result, _watch.EarlyExit) or result.is_failed():
                _stop(ctx)
            else:
                groups = []  # ranks that returned ended their own leftovers
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                _watch.interrupted_stacks(ctx, forwarder)
            _stop(ctx)
            raise
        finally:
            try:
                _end_leftovers(attempt_dir, plan.world_size, groups)
            finally:
                forwarder.stop()
    returned = frozenset(
        r for r in range(plan.world_size) if os.path.exists(returned_path(attempt_dir, r))
    )
    if not isinstance(result, _watch.EarlyExit) and not result.is_failed():
        return [result.return_values[r] for r in range(plan.world_size)]
    failures = {}
    for rank in range(plan.world_size):
        path = failure_path(attempt_dir, rank)
        if os.path.exists(path):
            with open(path) as fh:
                record = json.load(fh)
            record["traceback"] = localize(record.get("traceback", ""))
            failures[rank] = from_record(record, attempt)
    if isinstance(result, _watch.EarlyExit):
        failures[result.rank] = from_early_exit(result.rank, attempt)
        return failures, result.rank, returned
    exited_first = min(result.failures, default=None)
    if exited_first is not None and exited_first not in failures:
        # Died without raising (a signal, os._exit): that is what the others reacted to.
        failures[exited_first] = from_exit(
            exited_first, result.failures[exited_first].exitcode, attempt
        )
        return failures, exited_first, returned
    # Every rank that raised wrote a record; the earliest one is the cause, since
    # peers of a failed rank fail later, in the collective they were waiting in.
    first = min(failures.values(), key=lambda f: f.time or 0.0).rank if failures else None
    return failures, first, returned


def _end_leftovers(attempt_dir: str, world_size: int, groups: list[int]) -> None:
    """Stop what is left in the ranks' groups and tell the user what was left running."""
    left = {}
    for rank in range(world_size):
        path = leftovers_path(attempt_dir, rank)
        if os.path.exists(path):
            with open(path) as fh:
                left[rank] = json.load(fh)
    stray = _leftovers.end_groups(groups)  # only after a failure or interrupt are there any
    if stray:
        left.setdefault(-1, []).extend(stray)
    for rank, commands in sorted(left.items()):
        who = f"rank {rank}" if rank >= 0 else "the stopped ranks"
        _log.warning(
            "%s left %s running after the call ended; stopped: %s. End what a rank starts "
            "before it returns (join processes, close loaders).",
            who,
            "a process" if len(commands) == 1 else f"{len(commands)} processes",
            "; ".join(commands[:5]) + ("; ..." if len(commands) > 5 else ""),
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
        _stop(ctx)
        if isinstance(exc, SignalException):
            raise KeyboardInterrupt from exc
        if isinstance(exc, (OSError, pickle.PicklingError, RuntimeError)):
            raise LaunchError(f"the ranks could not be started: {exc}") from exc
        raise
    return ctx


def _stop(ctx: PContext) -> None:
    """Stop every rank: SIGTERM, then SIGKILL after a short grace; a second interrupt hurries it."""
    try:
        ctx.close(signal.SIGTERM, timeout=_INTERRUPT_GRACE_S)
    except KeyboardInterrupt:
        ctx.close(signal.SIGKILL, timeout=_INTERRUPT_GRACE_S)
        raise


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _elastic_quiet() -> Iterator[None]:
    dropper = _DropRecords()
    loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    for logger in loggers:
        logger.addFilter(dropper)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropper)
