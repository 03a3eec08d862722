"""Growing back: a group that shrank in place gets its lost slots again once they start.

After a shrink (:mod:`nbtools.launch._local._heal`) the slots lost for good are
tried again while the group trains at its smaller size, first
:data:`PROBE_EVERY_S` seconds apart, then twice as long after each try that fails,
up to :data:`PROBE_MAX_S`: :class:`Grower` starts a rank on each of them, numbered after the
ranks that run, for the next generation of the group, the world size it was
started with. A rank that cannot start yet (its process ends, or does not start
within the start wait) is stopped and tried again later, saying nothing: the
slot is still lost. Once every one has started, the caller asks the ranks to stop
at their next ``maybe_save`` (:func:`~nbtools.launch._rank.grow_path`; the live
tier raises ``GrowBoundary`` there in every rank at the same step), and once all
of them wait for the verdict, the group grows: the waiting ranks keep their
processes and numbers, the started ranks join them, and every rank takes the
state of that step as after a heal (a started rank takes rank 0's per-rank state:
its data position is the same on every rank; its random streams are rank 0's).
Growing counts as one restart; with none left the group stays at its size.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from torch.distributed.elastic.multiprocessing import PContext

from nbtools.launch._local._heal import START_WAIT_S, Heal, Healer, live_blob_path
from nbtools.launch._rank import (
    await_ending,
    failure_path,
    grow_path,
    runs_own_code,
    started_path,
    waiting_path,
)

__all__ = ["PROBE_EVERY_S", "PROBE_MAX_S", "Grower", "Probe"]

#: How soon a lost slot is tried again while the group runs at its smaller size, and the
#: longest wait once tries have failed (each failure doubles it).
PROBE_EVERY_S = 1.0
PROBE_MAX_S = 30.0
_STOP_GRACE_S = 2.0

#: Starts rank ``rank`` of ``world`` on ``slot`` in generation ``generation``, with the ranks
#: ``new`` joining and the attempt ``attempt``: its context and process.
Spawn = Callable[[int, int, int, int, list[int], int], tuple[PContext, psutil.Process | None]]


@dataclass
class Probe:
    """A rank started on a lost slot, waiting to join the grown group."""

    rank: int
    slot: int
    ctx: PContext
    proc: psutil.Process | None
    since: float


class Grower:
    """Tries a shrunk group's lost slots again and grows it back (see the module docstring)."""

    def __init__(self, run_dir: str, healer: Healer, spawn: Spawn) -> None:
        self._dir = run_dir
        self._healer = healer
        self._spawn = spawn
        self._probes: list[Probe] = []
        self._next = 0.0
        self._every = PROBE_EVERY_S
        self._asked: int | None = None  # the generation asked to stop at its next maybe_save

    def poll(self, running: dict[int, psutil.Process | None]) -> tuple[Heal, list[Probe]] | None:
        """One look: start, check or drop the probes; once the ranks ``running`` all wait at
        their boundary, grow (the heal that publishes it, and the ranks that join)."""
        healer = self._healer
        if not healer.lost or healer.why_not([], set()) is not None:
            return None
        if not self._probes:
            if time.monotonic() >= self._next:
                self._start()
            return None
        if self._asked is None:
            state = [self._state(p) for p in self._probes]
            if any(s is False for s in state):
                self.drop()
                self._next = time.monotonic() + self._every
                self._every = min(self._every * 2, PROBE_MAX_S)
            elif all(state):
                self._asked = healer.generation
                with open(grow_path(self._dir, healer.generation), "w"):
                    pass
            return None
        if not all(os.path.exists(waiting_path(self._dir, healer.generation, r)) for r in running):
            return None
        probes, self._probes = self._probes, []
        self._forget_request()
        self._every = PROBE_EVERY_S
        new = [p.rank for p in probes]
        heal = healer.grow(new, [p.slot for p in probes])
        for rank in new:  # the per-rank state of the step the ranks stopped at: rank 0's
            with contextlib.suppress(OSError):
                shutil.copyfile(live_blob_path(self._dir, 0), live_blob_path(self._dir, rank))
        return heal, probes

    def waiting(self) -> bool:
        """Whether the ranks were asked to stop for a grow (their wait is not an error)."""
        return self._asked is not None

    def _start(self) -> None:
        healer = self._healer
        world = healer.spec.world_size
        slots = sorted(healer.lost)
        target = world + len(slots)
        new = list(range(world, target))
        generation = healer.generation + 1
        attempt = healer.attempt + 1
        for rank, slot in zip(new, slots, strict=True):
            ctx, proc = self._spawn(rank, slot, target, generation, new, attempt)
            self._probes.append(Probe(rank, slot, ctx, proc, time.monotonic()))

    def _state(self, probe: Probe) -> bool | None:
        """True once ``probe`` started, False when it cannot (ended, or too slow), else None."""
        if os.path.exists(started_path(self._dir, self._healer.generation + 1, probe.rank)):
            return True
        if not runs_own_code(probe.proc) or time.monotonic() - probe.since > START_WAIT_S:
            return False
        return None

    def drop(self) -> None:
        """Stop the probes (a rank died meanwhile, the ranks returned, or one cannot start)."""
        probes, self._probes = self._probes, []
        self._forget_request()
        if not probes:
            return
        for probe in probes:
            if probe.proc is not None:
                with contextlib.suppress(psutil.Error):
                    probe.proc.kill()
        await_ending({p.rank: p.proc for p in probes}, _STOP_GRACE_S)
        generation = self._healer.generation + 1
        for probe in probes:
            for path in (
                started_path(self._dir, generation, probe.rank),
                failure_path(self._dir, probe.rank),
            ):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def _forget_request(self) -> None:
        if self._asked is not None:
            with contextlib.suppress(OSError):
                os.unlink(grow_path(self._dir, self._asked))
            self._asked = None
