"""The seam between what a launch means and where its ranks run.

A launch is the same everywhere: pack the function, start N ranks, forward
their output into the cell, wait for every rank's result or the first
failure, stop the others, restart the group up to ``max_restarts`` times
(:mod:`nbtools.launch._runner`). Only starting, watching and stopping the
ranks depends on the engine, and that is all a backend does:

- :class:`LaunchBackend` starts one group of ranks for one attempt;
- :class:`RankGroup` is that running group: where its output lands on this
  machine, a non-blocking :meth:`~RankGroup.poll` for the outcome, stacks on
  demand, and :meth:`~RankGroup.stop` / :meth:`~RankGroup.close`.

Backends: :mod:`nbtools.launch._local` (torch elastic on this machine) and
:mod:`nbtools.launch._ray` (Ray actors on a cluster). A new engine is one more
module with these two classes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nbtools.launch._failures import RankFailure
from nbtools.launch._results import Framed

__all__ = [
    "GroupSpec",
    "Finished",
    "Failed",
    "Outcome",
    "RankGroup",
    "LaunchBackend",
    "wait_for_stacks",
]


@dataclass(frozen=True)
class GroupSpec:
    """One attempt of a launch, as every backend receives it.

    Attributes:
        payload: cloudpickle bytes of ``(fn, args, kwargs)``; or, for a backend
            that runs a command loop, its entry payload.
        world_size: number of ranks.
        use_cuda: one GPU per rank (``cuda:LOCAL_RANK``) instead of CPU ranks.
        run_id: the same for every attempt of one call (``TORCHELASTIC_RUN_ID``).
        restart_count: 0 for the first attempt, then the restart number
            (``TORCHELASTIC_RESTART_COUNT``).
        max_restarts: the call's ``max_restarts`` (``TORCHELASTIC_MAX_RESTARTS``).
        attempt_dir: a private, empty directory on this machine for this attempt;
            the group's output files live here.
        env: extra environment variables for every rank (events channel, ...).
        heal: a rank that dies (a signal, ``os._exit``) is replaced while the
            others keep their processes, each heal one restart (see
            :mod:`nbtools.launch._local._heal`); where the backend cannot, the
            group fails as without it.
        min_world_size: with ``heal``, the fewest ranks the group may go on with
            when a rank's slot is lost for good (None: never fewer than
            ``world_size``); see :mod:`nbtools.launch._local._heal`.
    """

    payload: bytes
    world_size: int
    use_cuda: bool
    run_id: str
    restart_count: int
    max_restarts: int
    attempt_dir: str
    env: dict[str, str] = field(default_factory=dict)
    heal: bool = False
    min_world_size: int | None = None

    @property
    def backend(self) -> str:
        """The ``torch.distributed`` backend of the default group."""
        return "cpu:gloo,cuda:nccl" if self.use_cuda else "gloo"


@dataclass(frozen=True)
class Finished:
    """Every rank returned: ``results[r]`` is rank r's return value, pickled.

    Pickle bytes, or a pickle with its out-of-band buffers (a local rank's result file).
    ``heals``: how many times the group healed a dead rank in place (each a restart);
    ``world_size``: the ranks that returned, where the group had shrunk (None: as started).
    """

    results: list[bytes | Framed]
    heals: int = 0
    world_size: int | None = None


@dataclass(frozen=True)
class Failed:
    """At least one rank failed.

    Attributes:
        failures: what each failed rank reported (or how its process ended).
        first: the rank whose failure came first, the likely cause (None if unknown).
        returned: ranks whose function had returned before the failure.
        heals: how many times the group healed a dead rank in place before it failed.
        world_size: the ranks the group ran on when it failed, where it had shrunk (its
            lost slots stay lost: the next attempt starts that many); None: as started.
    """

    failures: dict[int, RankFailure]
    first: int | None
    returned: frozenset[int] = frozenset()
    heals: int = 0
    world_size: int | None = None


Outcome = Finished | Failed


class RankGroup(Protocol):
    """A running group of ranks, started by :meth:`LaunchBackend.start`.

    ``stdouts``/``stderrs`` map each global rank to a file on this machine
    that receives its output as it is written (the forwarder tails them).
    """

    stdouts: dict[int, str]
    stderrs: dict[int, str]

    def poll(self) -> Outcome | None:
        """The outcome once every rank returned or one failed; None while running.

        Never blocks for long: the runner calls it in a loop. After a failure
        the other ranks must already be stopping (not left in a collective).
        """
        ...

    def show_stacks(self, last_output: Callable[[], float]) -> None:
        """Make every running rank print its Python stacks to its stderr.

        ``last_output()`` is when output was last seen; return once the stacks
        have arrived (output quiet again) or after a few seconds.
        """
        ...

    def stop(self) -> None:
        """Stop every rank now (failure or interrupt); idempotent."""
        ...

    def close(self) -> dict[int, list[str]]:
        """Release what the group holds once it has ended; idempotent.

        Returns:
            ``{rank: [description, ...]}`` of processes ranks left running and
            that were stopped (rank -1: left by ranks that were stopped).
        """
        ...


class LaunchBackend(Protocol):
    """Starts groups of ranks somewhere: this machine, a Ray cluster, ..."""

    #: Shown in messages: "local", "ray".
    name: str
    #: Whether ranks may run on other machines: whatever talks to them from the
    #: caller (a pool's channel) must then listen on the network, not on a local socket.
    remote_nodes: bool
    #: Whether an interrupt reaches rank code blocked in ``time.sleep``, I/O or C code
    #: (a signal to the rank's main thread), not only running Python code.
    interrupts_blocked_calls: bool

    def gpu_count(self) -> int:
        """GPUs this engine can give ranks (``@distributed()`` without sizes uses them all)."""
        ...

    def check(self, world_size: int, use_cuda: bool) -> None:
        """Raise a clear error now when this engine cannot provide the ranks."""
        ...

    def start(self, spec: GroupSpec) -> RankGroup:
        """Start ``spec.world_size`` ranks running ``spec.payload``; returns at once.

        Raises:
            nbtools.errors.LaunchError: the ranks could not be started.
            KeyboardInterrupt: interrupted while starting; what started is stopped.
        """
        ...

    def close(self) -> None:
        """Release what the backend holds across attempts (placement, connections)."""
        ...


#: Stacks are complete once rank output has been quiet this long after they were asked for.
STACKS_QUIET_S = 0.3
#: The longest a backend waits for the stacks it asked for.
STACKS_LIMIT_S = 3.0


def wait_for_stacks(last_output: Callable[[], float], asked: float, poll_s: float) -> None:
    """Wait until the stacks asked for at ``asked`` (``time.monotonic()``) have been written.

    ``last_output`` gives the monotonic time of the ranks' last output line. Returns
    once output came after ``asked`` and then stayed quiet for ``STACKS_QUIET_S``, or
    after ``STACKS_LIMIT_S`` in any case (a rank stuck in C code never writes).
    """
    while time.monotonic() - asked < STACKS_LIMIT_S:
        time.sleep(poll_s)
        seen = last_output()
        if seen > asked and time.monotonic() - seen > STACKS_QUIET_S:
            return
