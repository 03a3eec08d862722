"""Healing and shrinking in place, the local group's side: which process each rank runs in now.

:class:`Mender` does what :class:`~nbtools.launch._local._backend.LocalGroup`
does when a rank dies without a word and its healer (:mod:`._heal`) lets the
group heal: the replacements it starts (:meth:`Mender.spawn`), a group that may
shrink waiting for each to start and going on without the slots that cannot
(:meth:`Mender._shrink`), and growing back (:mod:`._grow`).

A replacement is, where there is one, the spare rank :class:`Spares` keeps
parked: a process forked from the forkserver once the group has formed, which
has imported what the ranks' function refers to and waits on a pipe
(``nbtools.launch._rank._heal.park``). Taking it costs writing the rank's
environment and place to that pipe, not a process start and its imports. A new
spare is parked once the healed group has formed again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass

import psutil
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, Std

from nbtools import _torch_compat
from nbtools.launch import _env
from nbtools.launch._backend import GroupSpec
from nbtools.launch._local import _forkserver
from nbtools.launch._local._elastic import POLL_S, STOP_GRACE_S, ElasticQuiet, start
from nbtools.launch._local._grow import Grower
from nbtools.launch._local._heal import FAILED_STARTS, START_WAIT_S, Heal, Healer, live_blob_path
from nbtools.launch._rank import (
    GENERATION_ENV,
    REPLACED_ENV,
    RankSpec,
    await_ending,
    exit_code,
    failure_path,
    generation_formed_path,
    rank_variables,
    returned_path,
    runs_own_code,
    started_path,
    store_path,
)

__all__ = ["Healer", "Mender", "Spares", "Starts", "process", "PARK_AFTER_S", "SPARE_DEATHS"]

#: How long a group runs formed before a spare rank is parked for it.
PARK_AFTER_S = 0.25
#: Spares that die by themselves this many times in a row are not started again.
SPARE_DEATHS = 3


@dataclass(frozen=True)
class Starts:
    """What started the group's ranks, to start a replacement for one of them (a heal)."""

    base: dict[str, str]
    envs: dict[int, dict[str, str]]
    args: dict[int, tuple[bytes, RankSpec]]


class Mender:
    """Heals and shrinks one local group in place: its healer's decisions carried out on the
    group's processes (see the module docstring)."""

    def __init__(
        self,
        ctx: PContext,
        spec: GroupSpec,
        procs: dict[int, psutil.Process | None],
        groups: list[int],
        outputs: tuple[dict[int, str], dict[int, str]],
    ) -> None:
        #: What decides and says the heals (:mod:`._heal`).
        self.healer = Healer(spec)
        #: The group's own ``{rank: process}`` and the process groups its ranks lead: shared,
        #: changed in place as ranks are replaced and renumbered.
        self.procs = procs
        self.groups = groups
        self.stdouts, self.stderrs = outputs
        #: What started the group's ranks (set by ``LocalBackend._start``).
        self.starts: Starts | None = None
        # Replacements started by heals, each a context of its own; where each rank's
        # current process is: (context, index in it).
        self.replacements: list[PContext] = []
        self.where: dict[int, tuple[PContext, int]] = {r: (ctx, r) for r in procs}
        self.refused = -1  # the generation whose waiting ranks were told to fail
        #: The spare rank kept parked while the group may still heal.
        self.spares = Spares(self)
        # A group that may shrink grows back when its lost slots start again.
        self.grower = (
            Grower(spec.attempt_dir, self.healer, self.spawn)
            if self.healer.min_world is not None
            else None
        )

    @property
    def spec(self) -> GroupSpec:
        """The group as it runs now (its world size after a shrink or a grow)."""
        return self.healer.spec

    def shrunk(self) -> int | None:
        """The group's world size where it shrank in place, else None."""
        world = self.spec.world_size
        return world if world != len(self.starts.envs if self.starts else self.procs) else None

    def refuse_waiting(self) -> None:
        """Every rank still running waits for a verdict and none died: tell them to fail."""
        generation = self.healer.generation
        if self.refused == generation or (self.grower is not None and self.grower.waiting()):
            return
        attempt_dir = self.spec.attempt_dir
        running = [
            r
            for r, p in self.procs.items()
            if runs_own_code(p) and not os.path.exists(returned_path(attempt_dir, r))
        ]
        if self.healer.refuse_waiting(running):
            self.refused = generation

    def heal(self, returned: set[int]) -> bool:
        """Replace the ranks that died without a word, the others kept; whether it did."""
        if self.grower is not None:
            self.grower.drop()  # a lost slot is tried again once the group has healed
        self.healer.together()
        attempt_dir = self.spec.attempt_dir
        dead = [
            r
            for r, p in self.procs.items()
            if r not in returned
            and not runs_own_code(p)
            and not os.path.exists(failure_path(attempt_dir, r))
        ]
        why = self.healer.why_not(dead, returned)
        if why is not None or self.starts is None:
            self.healer.refuse(why or "the group cannot start a replacement", dead)
            return False
        heal = self.healer.begin(dead, {r: self.code(r) for r in dead})
        kept = [p.pid for r, p in self.procs.items() if r not in dead and p is not None]
        if self.healer.min_world is None:
            for rank in dead:
                self._replace(rank, heal)
        else:
            lost = self._start_replacements(dead, heal)
            if lost:
                self._shrink(heal, lost)
        self.healer.publish(heal, kept)
        return True

    def _start_replacements(self, ranks: list[int], heal: Heal) -> list[int]:
        """Start the replacements of ``ranks`` together and wait until each has started (a
        group that may shrink); the ranks whose slot failed :data:`FAILED_STARTS` tries."""
        pending = list(ranks)
        for tries in range(1, FAILED_STARTS + 1):
            for rank in pending:
                self._replace(rank, heal)
            failed = []
            for rank in pending:
                started, code = self._await_start(rank, heal.generation)
                if started:
                    continue
                failed.append(rank)
                self.healer.failed_start(rank, tries, code)
                with contextlib.suppress(OSError):  # its record would be read as a later rank's
                    os.unlink(failure_path(self.spec.attempt_dir, rank))
            pending = failed
            if not pending:
                break
        return pending

    def _await_start(self, rank: int, generation: int) -> tuple[bool, int | None]:
        """Whether rank ``rank``'s new process started, else its exit code (None: it did not
        start within :data:`START_WAIT_S` and was killed)."""
        path = started_path(self.spec.attempt_dir, generation, rank)
        proc = self.procs[rank]
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if os.path.exists(path):
                return True, None
            if not runs_own_code(proc):
                killed = await_ending({rank: proc}, STOP_GRACE_S)
                return False, None if killed is None else self.code(rank)
            time.sleep(POLL_S * 4)
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()
            await_ending({rank: proc}, STOP_GRACE_S)
        return False, None

    def _shrink(self, heal: Heal, lost: list[int]) -> None:
        """Go on without ``lost`` (their slots failed to start): renumber the ranks densely;
        a replacement of this heal whose number changes starts again under its new one."""
        ranks = self.healer.shrink(heal, lost)  # raises under the minimum
        moved = [old for old in heal.how if old in ranks and ranks[old] != old]
        for old in moved:
            proc = self.procs[old]
            if proc is not None:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
                await_ending({old: proc}, STOP_GRACE_S)
        procs = {new: self.procs[old] for old, new in ranks.items()}
        self.procs.clear()
        self.procs.update(procs)
        self.where = {new: self.where[old] for old, new in ranks.items()}
        attempt_dir = self.spec.attempt_dir
        for old in lost:  # a lost rank's per-rank state is no one's now
            with contextlib.suppress(OSError):
                os.unlink(live_blob_path(attempt_dir, old))
        for old, new in sorted(ranks.items(), key=lambda item: item[1]):
            if new != old and os.path.exists(live_blob_path(attempt_dir, old)):
                os.replace(live_blob_path(attempt_dir, old), live_blob_path(attempt_dir, new))
        for old in moved:
            self._replace(ranks[old], heal)

    def _replace(self, rank: int, heal: Heal) -> None:
        """Start a fresh rank ``rank`` from the forkserver, in generation ``heal.generation``
        (on the slot the group runs that rank on: as first started, or after a shrink)."""
        ctx, proc = self.spawn(
            rank,
            self.healer.slots[rank],
            self.spec.world_size,
            heal.generation,
            heal.ranks,
            heal.attempt,
        )
        self.procs[rank] = proc
        self.where[rank] = (ctx, 0)

    def spawn(
        self, rank: int, slot: int, world: int, generation: int, new: list[int], attempt: int
    ) -> tuple[PContext, psutil.Process | None]:
        """Start rank ``rank`` of ``world`` on ``slot`` from the forkserver, in ``generation``
        (``new``: the ranks that join the group in it, ``attempt`` its attempt number)."""
        assert self.starts is not None
        attempt_dir = self.spec.attempt_dir
        env = dict(self.starts.envs[slot])
        env.update(rank_variables(rank, world))
        env.update(
            {
                GENERATION_ENV: str(generation),
                REPLACED_ENV: ",".join(str(r) for r in new),
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
            }
        )
        payload, rank_spec = self.starts.args[slot]
        spec = dataclasses.replace(
            rank_spec,
            rank=rank,
            world_size=world,
            generation=generation,
            init_method="file://" + store_path(attempt_dir, generation),
            output=(self.stdouts[slot], self.stderrs[slot]),
            report_formed=False,
        )
        logs = DefaultLogsSpecs(
            log_dir=os.path.join(
                attempt_dir, "logs", f"g{generation}-rank{rank}-{len(self.replacements)}"
            ),
            redirects=Std.NONE,
        )
        ctx = self.spares.take(env, spec)  # the parked spare, where there is one
        if ctx is None:
            ctx = start({0: (payload, spec)}, {0: env}, logs, _env.START_METHOD)
        self.replacements.append(ctx)
        pid = ctx.pids()[0]
        if pid not in self.groups:
            self.groups.append(pid)
        run_dir = os.path.dirname(attempt_dir)
        _forkserver.note_launch(self.spec.run_id, run_dir, self.starts.base, self.groups)
        return ctx, process(pid)

    def grow(self) -> bool:
        """Try the lost slots again; once the ranks wait at their boundary, grow (whether it
        did, this poll)."""
        assert self.grower is not None
        grown = self.grower.poll(self.procs)
        if grown is None:
            return False
        heal, probes = grown
        kept = [p.pid for p in self.procs.values() if p is not None]
        for probe in probes:
            self.procs[probe.rank] = probe.proc
            self.where[probe.rank] = (probe.ctx, 0)
        self.healer.publish(heal, kept)
        return True

    def code(self, rank: int) -> int | None:
        """The exit code of rank ``rank``'s current process (None: unknown or running)."""
        ctx, index = self.where[rank]
        code = _torch_compat.process_exitcodes(ctx).get(index)
        proc = self.procs.get(rank)
        if code is None and proc is not None:
            code = exit_code(proc.pid)
        return code


class Spares:
    """One spare rank parked ahead of need, for :meth:`Mender.spawn` to take (see the module
    docstring).

    :meth:`keep` (each poll of the group) parks one from the forkserver, with its preloads
    done, once the group has run formed for :data:`PARK_AFTER_S` (a call that short heals
    rarely, and its first moments are the user's), while the group heals and has restarts
    left; it replaces a spare that died by itself (up to :data:`SPARE_DEATHS` in a row).
    :meth:`take` hands the parked spare a rank's slot over its pipe (in a group that may
    shrink, parking the next at once, for a second try of the slot). :meth:`drop` ends it
    (SIGKILL of its process group) once the group can no longer heal, and when it ends.
    """

    def __init__(self, mender: Mender) -> None:
        self._mender = mender
        self._spare: tuple[PContext, psutil.Process | None, str] | None = None
        self._count = 0  # spares started, for their pipes' and logs' names
        self._deaths = 0  # spares in a row that died by themselves
        self._formed: tuple[int, float] | None = None  # (generation, when seen formed)
        self.started: list[int] = []  # the spares' pids, in order

    @property
    def pid(self) -> int | None:
        """The parked spare's pid (None: none parked)."""
        return None if self._spare is None else self._spare[0].pids()[0]

    def keep(self, running: bool = True) -> None:
        """Park a spare when there should be one and is none (the group ``running``, able to
        heal); drop it when there should not."""
        mender = self._mender
        healer = mender.healer
        spec = healer.spec
        heals = healer.enabled and mender.starts is not None and spec.max_restarts > healer.attempt
        if not (running and heals):
            self.drop()
            return
        if self._spare is not None:
            if runs_own_code(self._spare[1]):
                return
            self.drop()  # died by itself: another takes its place
            self._deaths += 1
        if self._deaths >= SPARE_DEATHS or not self._settled() or not _forkserver.ready():
            return
        self._park()

    def _settled(self) -> bool:
        """Whether the group's current generation has run formed for :data:`PARK_AFTER_S`."""
        healer = self._mender.healer
        generation = healer.generation
        if self._formed is None or self._formed[0] != generation:
            run_dir = healer.spec.attempt_dir
            ranks = range(healer.spec.world_size)
            if not all(
                os.path.exists(generation_formed_path(run_dir, generation, r)) for r in ranks
            ):
                return False
            self._formed = (generation, time.monotonic())
        return time.monotonic() - self._formed[1] >= PARK_AFTER_S

    def _park(self) -> None:
        mender = self._mender
        assert mender.starts is not None
        attempt_dir = mender.spec.attempt_dir
        pipe = os.path.join(attempt_dir, f"spare-{self._count}.pipe")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pipe)
        os.mkfifo(pipe, 0o600)
        payload, rank_spec = mender.starts.args[0]
        spec = dataclasses.replace(rank_spec, spare=pipe, report_formed=False)
        logs = DefaultLogsSpecs(
            log_dir=os.path.join(attempt_dir, "logs", f"spare-{self._count}"),
            redirects=Std.NONE,
        )
        self._count += 1
        ctx = start({0: (payload, spec)}, {0: dict(mender.starts.envs[0])}, logs)
        pid = ctx.pids()[0]
        self.started.append(pid)
        mender.groups.append(pid)  # it leads its own process group, as a rank does
        run_dir = os.path.dirname(attempt_dir)
        _forkserver.note_launch(mender.spec.run_id, run_dir, mender.starts.base, mender.groups)
        self._spare = (ctx, process(pid), pipe)

    def take(self, env: dict[str, str], spec: RankSpec) -> PContext | None:
        """Hand the parked spare the rank ``spec`` with the environment ``env``: its context,
        or None where no spare takes it (none parked, or it died: start a fresh rank)."""
        if self._spare is None:
            return None
        ctx, proc, pipe = self._spare
        fd = self._open(proc, pipe)
        if fd is None:
            self.drop()
            return None
        take = {
            # torch gave the spare's own context its error file: the spare keeps it.
            "env": {k: v for k, v in env.items() if k != "TORCHELASTIC_ERROR_FILE"},
            "rank": spec.rank,
            "world_size": spec.world_size,
            "generation": spec.generation,
            "init_method": spec.init_method,
            "output": list(spec.output or ("", "")),
        }
        try:
            data = memoryview(json.dumps(take).encode())
            while data:
                data = data[os.write(fd, data) :]
        except OSError:
            self.drop()
            return None
        finally:
            os.close(fd)
        self._spare = None
        self._deaths = 0
        with contextlib.suppress(OSError):
            os.unlink(pipe)
        if self._mender.healer.min_world is not None:
            # A group that may shrink tries a slot twice before it is lost: the next spare
            # imports its preloads while this one starts, ready for that second try.
            self._park()
        return ctx

    @staticmethod
    def _open(proc: psutil.Process | None, pipe: str) -> int | None:
        """The pipe's writing end once the spare waits on it (it may still import its
        preloads: a fresh rank would import them too), None where it died first."""
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline and runs_own_code(proc):
            try:
                fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: not waiting on it yet
                time.sleep(POLL_S)
                continue
            os.set_blocking(fd, True)
            return fd
        return None

    def drop(self) -> None:
        """End the parked spare, if any (SIGKILL of its process group), and collect it."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        ctx, proc, pipe = spare
        pid = ctx.pids()[0]
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        quiet = ElasticQuiet()  # torch reports each process it closes
        try:
            ctx.close(signal.SIGKILL, timeout=STOP_GRACE_S)
        finally:
            quiet.close()
        with contextlib.suppress(OSError):
            os.unlink(pipe)


def process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
