"""One launch, whatever the engine: attempts, output, failures, restarts, events.

A launch runs attempts until one succeeds or ``max_restarts`` is used up. Each
attempt asks the backend (:mod:`nbtools.launch._backend`: local torch elastic
or Ray) for a group of ranks, forwards their output into the cell, waits for
the outcome (:mod:`nbtools.launch._watch`), and on a failure restarts the
whole group with ``TORCHELASTIC_RESTART_COUNT`` counting the attempts, as
torchrun does. A group that failed to form before any user code ran is formed
again without counting as a restart (:func:`until_formed`, which a pool's
ranks start through too).

The ranks' events reach the kernel through a :class:`nbtools.events.Collector`
that lives for the whole call; the launch itself emits ``launch``,
``restart`` and ``failure`` events.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from nbtools import events
from nbtools._internal import hooks
from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError
from nbtools.launch import _termination, _watch
from nbtools.launch._backend import Failed, GroupSpec, LaunchBackend, Outcome
from nbtools.launch._failures import describe, forms_again
from nbtools.launch._output import OutputForwarder
from nbtools.launch._rank import is_library_service, setup_environment

__all__ = ["Plan", "run", "until_formed", "report_leftovers"]

_log = get_logger("launch")
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """What to launch: how many ranks, on which device, how often to retry."""

    world_size: int
    use_cuda: bool
    max_restarts: int
    output: str
    hang_timeout: float | None = None
    on_hang: str = "report"
    rich_output: str = "rank0"
    heal: bool = False
    results_device: str = "cpu"
    #: With ``heal``: the fewest ranks the run may go on with when slots are lost for good.
    min_world_size: int | None = None

    @property
    def backend(self) -> str:
        return "cpu:gloo,cuda:nccl" if self.use_cuda else "gloo"


def run(
    payload: bytes,
    plan: Plan,
    localize: Callable[[str], str] = lambda text: text,
    backend: LaunchBackend | None = None,
) -> list[bytes]:
    """Run the payload on ``plan.world_size`` ranks; return each rank's pickled result.

    Args:
        payload: cloudpickle bytes of ``(fn, args, kwargs)``.
        plan: sizes and options.
        localize: rewrites remote tracebacks so notebook cells show their source.
        backend: where the ranks run (default: this machine).

    Raises:
        DistributedError: a rank failed in the last allowed attempt.
        KeyboardInterrupt: the caller was interrupted; every rank has been stopped.

    SIGTERM or SIGHUP during the launch stop the ranks and clean up as an interrupt
    does, then end this process by that signal (:mod:`._termination`).
    """
    with _termination.ends_launch():
        return _run(payload, plan, localize, backend)
    raise AssertionError("unreachable")  # pragma: no cover - the signal ended the process


def _run(
    payload: bytes,
    plan: Plan,
    localize: Callable[[str], str],
    backend: LaunchBackend | None,
) -> list[bytes]:
    if backend is None:
        from nbtools.launch._local import LocalBackend

        backend = LocalBackend()
    run_dir = tempfile.mkdtemp(prefix="nbtools-launch-")
    run_id = uuid.uuid4().hex[:12]
    collector = events.Collector(run_dir).start()
    indexes = itertools.count()
    restarts = 0
    first_steps = _watch.FirstSteps()  # the start-up bound learned carries across restarts
    world = plan.world_size  # fewer once the group shrank: its lost slots stay lost
    began = time.perf_counter()

    def attempt() -> Outcome:
        index = next(indexes)
        attempt_dir = os.path.join(run_dir, f"attempt{index}")
        spec = GroupSpec(
            payload=payload,
            world_size=world,
            use_cuda=plan.use_cuda,
            run_id=run_id,
            restart_count=restarts,
            max_restarts=plan.max_restarts,
            attempt_dir=attempt_dir,
            heal=plan.heal,
            min_world_size=plan.min_world_size,
            env={
                **collector.environment(),
                **setup_environment(attempt_dir, plan.rich_output, plan.results_device),
            },
        )
        os.mkdir(spec.attempt_dir)
        first = began if index == 0 else None
        outcome = _attempt(backend, spec, plan, localize, first, first_steps)
        collector.drain()  # the attempt's ranks have ended: everything they sent is here
        return outcome

    try:
        while True:
            outcome = until_formed(attempt)
            restarts += outcome.heals  # each rank healed in place was one restart
            if outcome.world_size is not None:
                world = outcome.world_size
            if not isinstance(outcome, Failed):
                events.emit(
                    "finished",
                    f"{world} ranks returned",
                    seconds=round(time.perf_counter() - began, 3),
                    restarts=restarts,
                )
                return outcome.results
            cause = outcome.failures[outcome.first] if outcome.first is not None else None
            headline = describe(outcome.failures, outcome.first, returned=outcome.returned)
            headline = headline.splitlines()[0]
            if cause is not None:
                events.emit(
                    "rank_failed",
                    headline,
                    rank=cause.rank,
                    reason=cause.exc_type,
                    node=cause.node or None,
                    attempt=restarts,
                )
            if restarts >= plan.max_restarts:
                break
            restarts += 1
            events.emit("restart", headline, attempt=restarts, max_restarts=plan.max_restarts)
            _log.warning(
                "%s; restarting all %d ranks (restart %d of %d)",
                headline,
                world,
                restarts,
                plan.max_restarts,
            )
        message = describe(
            outcome.failures,
            outcome.first,
            attempts=plan.max_restarts + 1,
            returned=outcome.returned,
        )
        events.emit("failure", message.splitlines()[0], attempts=restarts + 1)
        raise DistributedError(message, outcome.failures)
    finally:
        try:
            collector.stop()
            backend.close()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            hooks.launch_ended(run_id)


def until_formed(attempt: Callable[[], T]) -> T:
    """Run ``attempt`` again while its group failed to form before any user code ran.

    The one regroup loop of nbtools: every attempt of a plain call and every
    generation of a pool's ranks start through it. ``attempt()`` starts a group
    and returns its outcome (a :class:`Failed` when it failed, anything else
    when not); a failure in the ``group`` phase is retried up to
    :data:`~nbtools.launch._failures.REGROUPS` times, unseen by the user
    (:func:`~nbtools.launch._failures.forms_again`), and any other outcome is
    returned as it is.
    """
    regroups = 0
    while True:
        outcome = attempt()
        if not isinstance(outcome, Failed):
            return outcome
        cause = outcome.failures.get(outcome.first) if outcome.first is not None else None
        if not forms_again(cause, regroups):
            return outcome
        regroups += 1


def _attempt(
    backend: LaunchBackend,
    spec: GroupSpec,
    plan: Plan,
    localize: Callable[[str], str],
    began: float | None = None,
    first_steps: _watch.FirstSteps | None = None,
):
    launched = time.monotonic()  # the ranks' start-up bound counts from here
    group = backend.start(spec)
    if began is not None:  # the first attempt: the launch as the timeline shows it
        events.emit(
            "launch",
            f"{plan.world_size} ranks ({backend.name})",
            world_size=plan.world_size,
            cluster=backend.name,
            startup_s=round(time.perf_counter() - began, 3),
        )
    forwarder = OutputForwarder(
        group.stdouts, group.stderrs, plan.output, sys.stdout, sys.stderr, localize
    )
    forwarder.start()
    try:
        outcome = _watch.watch(
            group, forwarder, plan.hang_timeout, plan.on_hang, first_steps, launched
        )
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            _watch.interrupted_stacks(group, forwarder)
            exc.stacks = forwarder.stacks  # type: ignore[attr-defined]  # the cell shows them folded
        group.stop()
        raise
    finally:
        try:
            report_leftovers(group.close())
        finally:
            forwarder.stop()
    if isinstance(outcome, Failed):
        failures = {
            rank: dataclasses.replace(f, traceback=localize(f.traceback)) if f.traceback else f
            for rank, f in outcome.failures.items()
        }
        outcome = dataclasses.replace(outcome, failures=failures)
    return outcome


def report_leftovers(left: dict[int, list[str]]) -> None:
    """Tell the user what ranks left running after the call (already stopped).

    ``left[rank]`` is what a rank's code left behind after its function returned:
    a warning, with advice that applies. ``left[-1]`` is what was still running
    in the groups of ranks nbtools itself stopped (after a failure, an interrupt
    or a restart): nbtools ended it as part of stopping them, so the user's code
    did nothing wrong, and only the debug log says so.
    """
    for rank, found in sorted(left.items()):
        services = [c for c in found if is_library_service(c)]
        if services:
            # A library's own per-process service (wandb-core): it ends at interpreter exit,
            # which a rank reaches only after this; nothing for the user to change.
            _log.info("rank %d: stopped %s", rank, "; ".join(services))
        commands = [c for c in found if c not in services]
        if not commands:
            continue
        what = "a process" if len(commands) == 1 else f"{len(commands)} processes"
        named = "; ".join(commands[:5]) + ("; ..." if len(commands) > 5 else "")
        if rank < 0:
            _log.debug("stopped %s the stopped ranks had started: %s", what, named)
            continue
        _log.warning(
            "rank %d left %s running after its function returned; stopped: %s. End what a "
            "rank starts before it returns (join processes, close loaders).",
            rank,
            what,
            named,
        )
