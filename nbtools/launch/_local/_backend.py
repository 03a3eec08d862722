"""The local launch backend: ranks on this machine, started by torch's elastic machinery.

Each attempt is one ``PContext`` of ``torch.distributed.elastic.multiprocessing``
(forkserver start method; ``spawn`` while the forkserver is still importing its
preloads, so that a first call right after the decoration does not wait for
imports its ranks may not need). Rendezvous is a ``FileStore`` in the attempt's
private directory: nothing listens on a port for it, and gloo/nccl are pinned
to the loopback interface. Ranks publish failure records, "returned" marks and
the processes they left running as files in the attempt directory
(:mod:`nbtools.launch._rank._worker`); :meth:`LocalGroup.poll` reads them.

A rank that failed makes the context stop the others at once instead of
leaving them in a collective; what ranks leave running is ended by them or,
after a failure or an interrupt, here (:mod:`nbtools.launch._rank._leftovers`).

A rank that dies without a word (a signal, the OOM killer, ``os._exit``) is
seen as soon as it runs no more code (``_leftovers.ending``), not once the
kernel has released its memory and torch has collected its exit status: a
process of a few GB takes a tenth of a second or more to release, a rank with
memory snapshots mapped longer. Its peers are stopped at once; on CPU ranks the
next attempt then starts at once and the stopped ranks are collected in the
background (:meth:`LocalBackend.close` waits for that); ranks on GPUs are
collected first, since their device memory is free only once they are gone. A
rank that raised is left to torch as before: its peers may be raising too and
write their own records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    PContext,
    RunProcsResult,
    SignalException,
    Std,
)

from nbtools import _torch_compat
from nbtools.launch import _env, _results
from nbtools.launch._backend import Failed, Finished, GroupSpec, Outcome, wait_for_stacks
from nbtools.launch._failures import RankFailure, from_early_exit, from_exit, from_record
from nbtools.launch._local import _forkserver
from nbtools.launch._local._elastic import (
    POLL_S,
    STOP_GRACE_S,
    ElasticQuiet,
    catches,
    exit_status,
    start,
    with_full_disk,
)
from nbtools.launch._local._grow import Grower
from nbtools.launch._local._heal import (
    FAILED_STARTS,
    START_WAIT_S,
    Heal,
    Healer,
    live_blob_path,
)
from nbtools.launch._rank import (
    GENERATION_ENV,
    REPLACED_ENV,
    STACK_SIGNAL,
    RankSpec,
    await_ending,
    end_groups,
    exit_code,
    failure_path,
    formed_path,
    heal_environment,
    leftovers_path,
    rank_variables,
    release_path,
    returned_path,
    runs_own_code,
    started_path,
    store_path,
)

__all__ = ["LocalBackend", "LocalGroup"]

# How long ended ranks may take to be collected in the background (their memory released).
_COLLECT_S = 30
# How long a first call waits for a forkserver started a moment ago to settle, so that it
# can be stopped while the ranks start fresh (it settles in a fraction of a second).
_SETTLE_WAIT_S = 2.0


class LocalBackend:
    """Starts ranks on this machine from the forkserver (see the module docstring)."""

    name = "local"
    remote_nodes = False
    interrupts_blocked_calls = True

    def __init__(self) -> None:
        self._groups: list[LocalGroup] = []
        self._runs: set[str] = set()  # run ids recorded for the forkserver (_forkserver)

    def gpu_count(self) -> int:
        """GPUs torch sees on this machine."""
        return _env.visible_gpu_count()

    def check(self, world_size: int, use_cuda: bool) -> None:
        """Start the forkserver if needed (GPU counts are checked by the caller's plan)."""
        _env.warm_up()

    def start(self, spec: GroupSpec) -> LocalGroup:
        """Start the ranks of one attempt."""
        self._groups = [g for g in self._groups if not g.collected()]
        _env.warm_up()
        method, paused = _start_method(spec.world_size)
        try:
            group = self._start(spec, method, paused)
        except BaseException:
            _forkserver.resume(paused)
            raise
        self._groups.append(group)
        return group

    def _start(self, spec: GroupSpec, method: str, paused: int | None) -> LocalGroup:
        base = _env.caller_environment()
        base.update(spec.env)
        base.update(_forkserver.rank_environment(base))
        if spec.heal and not spec.use_cuda:
            base.update(heal_environment(spec.attempt_dir, spec.world_size))
        if spec.run_id not in self._runs:
            # Should this process die before the launch ends, the forkserver ends it.
            _forkserver.note_launch(spec.run_id, os.path.dirname(spec.attempt_dir), base)
            self._runs.add(spec.run_id)
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
                init_method="file://" + store_path(spec.attempt_dir, 0),
                run_dir=spec.attempt_dir,
                caller_pid=os.getpid(),
                env_names=frozenset(envs[rank]),
                report_formed=method != _env.START_METHOD,
                heal=spec.heal and not spec.use_cuda,
            )
            args[rank] = (spec.payload, rank_spec)
        logs = DefaultLogsSpecs(log_dir=os.path.join(spec.attempt_dir, "logs"), redirects=Std.ALL)
        quiet = ElasticQuiet()
        try:
            ctx = start(args, envs, logs, method)
        except BaseException:
            quiet.close()
            raise
        group = LocalGroup(ctx, spec, quiet, paused)
        group.starts = _Starts(base, envs, args)
        groups = list(ctx.pids().values())  # each rank leads its own process group
        _forkserver.note_launch(spec.run_id, os.path.dirname(spec.attempt_dir), base, groups)
        return group

    def close(self) -> None:
        """Wait until the stopped ranks of earlier attempts are collected."""
        groups, self._groups = self._groups, []
        for group in groups:
            group.collect()
        runs, self._runs = self._runs, set()
        for run_id in runs:
            _forkserver.forget_launch(run_id)


@dataclass(frozen=True)
class _Starts:
    """What started the group's ranks, to start a replacement for one of them (a heal)."""

    base: dict[str, str]
    envs: dict[int, dict[str, str]]
    args: dict[int, tuple[bytes, RankSpec]]


@dataclass(frozen=True)
class _Vanished:
    """A rank that ended without returning, and torch's report of the group where it has one.

    ``report`` is ``None`` when torch has not seen the end yet (a busy host): the
    launcher goes by the rank's record or exit code, or by ``codes``, every rank's
    exit code once all have ended (torch collects them in the background).
    """

    rank: int
    report: RunProcsResult | None
    codes: dict[int, int] | None = None


class LocalGroup:
    """One attempt's ranks; implements :class:`~nbtools.launch._backend.RankGroup`."""

    def __init__(
        self, ctx: PContext, spec: GroupSpec, quiet: ElasticQuiet, paused: int | None = None
    ) -> None:
        self._ctx = ctx
        self._paused = paused  # the forkserver, stopped until this group has formed
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
        self._collector: threading.Thread | None = None  # see _collect_later
        self._killed: set[int] = set()  # ranks that needed SIGKILL to end (_exit_codes)
        self.starts: _Starts | None = None  # set by LocalBackend._start
        self._healer = Healer(spec)
        # Replacements started by heals, each a context of its own; where each rank's
        # current process is: (context, index in it).
        self._replacements: list[PContext] = []
        self._where: dict[int, tuple[PContext, int]] = {r: (ctx, r) for r in self._procs}
        self._refused = -1  # the generation whose waiting ranks were told to fail
        # A group that may shrink grows back when its lost slots start again.
        self._grower = (
            Grower(spec.attempt_dir, self._healer, self._spawn)
            if self._healer.min_world is not None
            else None
        )

    @property
    def healer(self) -> Healer:
        """What decides and says this group's heals in place (``heals``, ``announce``)."""
        return self._healer

    def poll(self) -> Outcome | None:
        if self._outcome is not None:
            return self._outcome
        if self._paused is not None and self._formed():
            self._resume_forkserver()
        try:
            # A rank that has ended is seen before torch collects it (see the module
            # docstring); torch's own poll then reports the rest.
            gone = self._vanished()
            if self._healer.count:
                self._outcome = self._poll_healed(gone)
                return self._outcome
            if gone is None and self._healer.enabled:
                self._refuse_waiting()
            if gone is not None and gone.codes is not None:
                self._collect_later()
                self._outcome = self._ended(gone.rank, gone.codes)
                return self._outcome
            result = self._ctx.wait(0) if gone is None else gone.report
            early = None
            if result is None:
                if gone is None:
                    time.sleep(POLL_S)
                    return None
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

    def _poll_healed(self, gone: _Vanished | None) -> Outcome | None:
        """The outcome of a group that healed: torch's first context no longer knows it."""
        heals = self._healer.count
        if gone is None:
            self._healer.report()
            if self._grower is not None:
                if self._released:
                    self._grower.drop()
                elif self._grow():
                    return None
            self._refuse_waiting()
            if not self._released:
                time.sleep(POLL_S)
                return None
            for ctx in self._contexts():
                _torch_compat.release_returned(ctx)  # torch's wait cannot, for the first
            if any(runs_own_code(p) for p in self._procs.values()):
                time.sleep(POLL_S)
                return None
            self._healer.report(final=True)
            self._groups = []  # ranks that returned ended their own leftovers
            self._collect_later()
            world = self._spec.world_size
            return Finished(
                [self._result(r) for r in range(world)], heals=heals, world_size=self._shrunk()
            )
        self._healer.report(final=True)
        self._terminate(exclude=gone.rank)
        codes = gone.codes if gone.codes is not None else self._exit_codes()
        self._collect_later()
        if codes is None:  # a rank stuck in the kernel: go by the records alone
            self._stopped = True
            failed = self._failed(None, gone.rank, {}, first=gone.rank)
        else:
            failed = self._ended(gone.rank, codes)
        return dataclasses.replace(failed, heals=heals, world_size=self._shrunk())

    def _shrunk(self) -> int | None:
        """The group's world size where it shrank in place, else None."""
        world = self._spec.world_size
        return world if world != len(self.starts.envs if self.starts else self._procs) else None

    def _refuse_waiting(self) -> None:
        """Every rank still running waits for a verdict and none died: tell them to fail."""
        generation = self._healer.generation
        if self._refused == generation or (self._grower is not None and self._grower.waiting()):
            return
        attempt_dir = self._spec.attempt_dir
        running = [
            r
            for r, p in self._procs.items()
            if runs_own_code(p) and not os.path.exists(returned_path(attempt_dir, r))
        ]
        if self._healer.refuse_waiting(running):
            self._refused = generation

    def _heal(self, returned: set[int]) -> bool:
        """Replace the ranks that died without a word, the others kept; whether it did."""
        if self._grower is not None:
            self._grower.drop()  # a lost slot is tried again once the group has healed
        self._healer.together()
        attempt_dir = self._spec.attempt_dir
        dead = [
            r
            for r, p in self._procs.items()
            if r not in returned
            and not runs_own_code(p)
            and not os.path.exists(failure_path(attempt_dir, r))
        ]
        why = self._healer.why_not(dead, returned)
        if why is not None or self.starts is None:
            self._healer.refuse(why or "the group cannot start a replacement", dead)
            return False
        heal = self._healer.begin(dead, {r: self._code(r) for r in dead})
        kept = [p.pid for r, p in self._procs.items() if r not in dead and p is not None]
        if self._healer.min_world is None:
            for rank in dead:
                self._replace(rank, heal)
        else:
            lost = [r for r in dead if not self._start_replacement(r, heal)]
            if lost:
                self._shrink(heal, lost)
        self._healer.publish(heal, kept)
        return True

    def _start_replacement(self, rank: int, heal: Heal) -> bool:
        """Start rank ``rank``'s replacement and wait until it has started (a group that may
        shrink); whether it did, within :data:`FAILED_STARTS` tries."""
        for tries in range(1, FAILED_STARTS + 1):
            self._replace(rank, heal)
            started, code = self._await_start(rank, heal.generation)
            if started:
                return True
            self._healer.failed_start(rank, tries, code)
            with contextlib.suppress(OSError):  # its record would be read as a later rank's
                os.unlink(failure_path(self._spec.attempt_dir, rank))
        return False

    def _await_start(self, rank: int, generation: int) -> tuple[bool, int | None]:
        """Whether rank ``rank``'s new process started, else its exit code (None: it did not
        start within :data:`START_WAIT_S` and was killed)."""
        path = started_path(self._spec.attempt_dir, generation, rank)
        proc = self._procs[rank]
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if os.path.exists(path):
                return True, None
            if not runs_own_code(proc):
                killed = await_ending({rank: proc}, STOP_GRACE_S)
                return False, None if killed is None else self._code(rank)
            time.sleep(POLL_S * 4)
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()
            await_ending({rank: proc}, STOP_GRACE_S)
        return False, None

    def _shrink(self, heal: Heal, lost: list[int]) -> None:
        """Go on without ``lost`` (their slots failed to start): renumber the ranks densely;
        a replacement of this heal whose number changes starts again under its new one."""
        ranks = self._healer.shrink(heal, lost)  # raises under the minimum
        self._spec = self._healer.spec
        moved = [old for old in heal.how if old in ranks and ranks[old] != old]
        for old in moved:
            proc = self._procs[old]
            if proc is not None:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
                await_ending({old: proc}, STOP_GRACE_S)
        self._procs = {new: self._procs[old] for old, new in ranks.items()}
        self._where = {new: self._where[old] for old, new in ranks.items()}
        attempt_dir = self._spec.attempt_dir
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
        ctx, proc = self._spawn(
            rank,
            self._healer.slots[rank],
            self._spec.world_size,
            heal.generation,
            heal.ranks,
            heal.attempt,
        )
        self._procs[rank] = proc
        self._where[rank] = (ctx, 0)

    def _spawn(
        self, rank: int, slot: int, world: int, generation: int, new: list[int], attempt: int
    ) -> tuple[PContext, psutil.Process | None]:
        """Start rank ``rank`` of ``world`` on ``slot`` from the forkserver, in ``generation``
        (``new``: the ranks that join the group in it, ``attempt`` its attempt number)."""
        assert self.starts is not None
        attempt_dir = self._spec.attempt_dir
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
                attempt_dir, "logs", f"g{generation}-rank{rank}-{len(self._replacements)}"
            ),
            redirects=Std.NONE,
        )
        ctx = start({0: (payload, spec)}, {0: env}, logs, _env.START_METHOD)
        self._replacements.append(ctx)
        pid = ctx.pids()[0]
        self._groups.append(pid)
        run_dir = os.path.dirname(attempt_dir)
        _forkserver.note_launch(self._spec.run_id, run_dir, self.starts.base, self._groups)
        return ctx, _process(pid)

    def _grow(self) -> bool:
        """Try the lost slots again; once the ranks wait at their boundary, grow (whether it
        did, this poll)."""
        assert self._grower is not None
        grown = self._grower.poll(self._procs)
        if grown is None:
            return False
        heal, probes = grown
        kept = [p.pid for p in self._procs.values() if p is not None]
        for probe in probes:
            self._procs[probe.rank] = probe.proc
            self._where[probe.rank] = (probe.ctx, 0)
        self._spec = self._healer.spec
        self._healer.publish(heal, kept)
        return True

    def _code(self, rank: int) -> int | None:
        """The exit code of rank ``rank``'s current process (None: unknown or running)."""
        ctx, index = self._where[rank]
        code = _torch_compat.process_exitcodes(ctx).get(index)
        proc = self._procs.get(rank)
        if code is None and proc is not None:
            code = exit_code(proc.pid)
        return code

    def _contexts(self) -> list[PContext]:
        return [self._ctx, *self._replacements]

    def _formed(self) -> bool:
        attempt_dir = self._spec.attempt_dir
        return all(os.path.exists(formed_path(attempt_dir, r)) for r in self._procs)

    def _resume_forkserver(self) -> None:
        _forkserver.resume(self._paused)
        self._paused = None

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
            if rank not in returned and not runs_own_code(proc):
                if self._healer.count and os.path.exists(failure_path(attempt_dir, rank)):
                    return _Vanished(rank, None)  # torch's first context knows no longer
                if os.path.exists(failure_path(attempt_dir, rank)):
                    # It raised: its peers may be raising too, and write their own records,
                    # or fail in the collective it left; torch stops the rest once it has
                    # collected this one.
                    return _Vanished(rank, exit_status(self._ctx))
                # Died without a word (a signal, os._exit): the others wait for it in a
                # collective; heal it in place, or stop them now.
                if self._healer.enabled and self._heal(returned):
                    return None
                self._terminate(exclude=rank)
                if self._healer.count:
                    return _Vanished(rank, None)  # torch's first context knows no longer
                if not self._spec.use_cuda:
                    codes = self._exit_codes()
                    if codes is not None:
                        return _Vanished(rank, None, codes)
                return _Vanished(rank, exit_status(self._ctx))
        return None

    def _terminate(self, exclude: int) -> None:
        """SIGTERM every rank but ``exclude`` that still runs."""
        for rank, proc in self._procs.items():
            if rank != exclude and runs_own_code(proc):
                with contextlib.suppress(psutil.Error, OSError):
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGCONT)  # a stopped rank acts on it only so

    def _exit_codes(self) -> dict[int, int] | None:
        """Every rank's exit code once all have ended (SIGKILL after a grace); None where a
        code cannot be read (torch then reports, as it collects them)."""
        killed = await_ending(self._procs, STOP_GRACE_S)
        if killed is None:
            return None  # stuck (uninterruptible): torch's own stop deals with it
        self._killed |= killed
        codes: dict[int, int] = {}
        for rank in self._procs:
            code = self._code(rank)
            if code is None:
                return None
            codes[rank] = code
        return codes

    def _ended(self, rank: int, codes: dict[int, int]) -> Failed:
        """The outcome once every rank has ended, ``rank`` the first seen to."""
        self._stopped = True
        # A rank that needed SIGKILL after the grace was stopped, as one ended by SIGTERM.
        exited = {r: c for r, c in codes.items() if c and r not in self._killed}
        return self._failed(None, None if codes[rank] else rank, exited, first=rank)

    def _collect_later(self) -> None:
        """Collect the ended ranks' exit statuses, and their memory, in the background."""

        def collect() -> None:
            try:
                for ctx in self._contexts():
                    ctx.close(signal.SIGKILL, timeout=_COLLECT_S)
            finally:
                self._quiet.close()  # torch reports each process it closes: silenced till now

        self._collector = threading.Thread(
            target=collect, name="nbtools-collect-ranks", daemon=True
        )
        self._collector.start()

    def collected(self) -> bool:
        """Whether this group's ranks are all collected (none is being, in the background)."""
        return self._collector is None or not self._collector.is_alive()

    def collect(self) -> None:
        """Wait until this group's ended ranks are collected (a few seconds at most)."""
        if self._collector is not None:
            self._collector.join()

    def _failed(
        self, result, early: int | None, exited: dict[int, int], first: int | None = None
    ) -> Failed:
        """The failure: from torch's ``result``, or, where it has none, from ``early`` (a
        rank gone without a known exit code) or the ranks' ``exited`` codes and the
        rank seen to end ``first``."""
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

    def show_stacks(self, last_output: Callable[[], float]) -> None:
        sent = False
        for proc in self._procs.values():
            # A rank still starting has no handler yet: the signal would kill it.
            if runs_own_code(proc) and catches(proc.pid, STACK_SIGNAL):
                with contextlib.suppress(psutil.Error, OSError):
                    proc.send_signal(STACK_SIGNAL)
                    sent = True
        if not sent:
            return
        start = time.monotonic()
        wait_for_stacks(last_output, start, POLL_S * 10)

    def stop(self) -> None:
        """SIGTERM every rank, then SIGKILL after a short grace; a second interrupt hurries it."""
        self._resume_forkserver()
        if self._stopped:
            return
        self._stopped = True
        self._resume()
        try:
            for ctx in self._contexts():
                ctx.close(signal.SIGTERM, timeout=STOP_GRACE_S)
        except KeyboardInterrupt:
            for ctx in self._contexts():
                ctx.close(signal.SIGKILL, timeout=STOP_GRACE_S)
            raise

    def _resume(self) -> None:
        """SIGCONT every rank's process group: a stopped process acts on SIGTERM only once
        continued (systemd does the same), and SIGKILL needs no help."""
        for pgid in self._groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGCONT)

    def close(self) -> dict[int, list[str]]:
        if self._closed:
            return {}
        self._closed = True
        self._resume_forkserver()
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
            stray = end_groups(self._groups)
            if stray:
                left.setdefault(-1, []).extend(stray)
            return left
        finally:
            if self._collector is None:
                self._quiet.close()


def _start_method(world_size: int) -> tuple[str, int | None]:
    """How this attempt's ranks start, and the forkserver's pid if it was stopped for them.

    A forkserver still importing its preloads would hold the ranks back until it
    has all of them. Ranks started fresh (``spawn``) import only what they use,
    in parallel: they start sooner where they have cores of their own, or where
    the forkserver can be stopped meanwhile (:func:`_forkserver.pause`); else
    waiting for the forkserver is the faster way.
    """
    if _forkserver.ready():
        return _env.START_METHOD, None
    paused = _forkserver.pause(wait=_SETTLE_WAIT_S)
    if paused is not None or _cores() >= world_size + 2:
        return "spawn", paused
    return _env.START_METHOD, None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
