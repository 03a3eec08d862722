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
write their own records. Healing in place, with its spare rank, is in :mod:`._mend`.
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
from nbtools.launch._local import _forkserver
from nbtools.launch._local._elastic import (
    POLL_S,
    STOP_GRACE_S,
    ElasticQuiet,
    catches,
    exit_status,
    failed,
    start,
)
from nbtools.launch._local._mend import Healer, Mender, Starts, process
from nbtools.launch._rank import (
    STACK_SIGNAL,
    RankSpec,
    await_ending,
    end_groups,
    failure_path,
    formed_path,
    heal_environment,
    leftovers_path,
    release_path,
    returned_path,
    runs_own_code,
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
        group.mender.starts = Starts(base, envs, args)
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
        self._quiet = quiet
        self.stdouts: dict[int, str] = ctx.stdouts
        self.stderrs: dict[int, str] = ctx.stderrs
        self._procs = {rank: process(pid) for rank, pid in ctx.pids().items()}
        self._groups = list(ctx.pids().values())  # each rank leads its own process group
        self._released = False
        self._stopped = False
        self._closed = False
        self._outcome: Outcome | None = None
        self._collector: threading.Thread | None = None  # see _collect_later
        self._killed: set[int] = set()  # ranks that needed SIGKILL to end (_exit_codes)
        # Heals and shrinks in place; shares the group's processes and process groups.
        self.mender = Mender(ctx, spec, self._procs, self._groups, (self.stdouts, self.stderrs))

    @property
    def _spec(self) -> GroupSpec:
        """The group as it runs now (its world size after a shrink or a grow)."""
        return self.mender.spec

    @property
    def healer(self) -> Healer:
        """What decides and says this group's heals in place (``heals``, ``announce``)."""
        return self.mender.healer

    def poll(self) -> Outcome | None:
        if self._outcome is not None:
            return self._outcome
        outcome = self._poll()
        # One spare rank parked while the group may heal; none once it has ended or returned.
        self.mender.spares.keep(running=outcome is None and not self._released)
        return outcome

    def _poll(self) -> Outcome | None:
        if self._paused is not None and self._formed():
            self._resume_forkserver()
        try:
            # A rank that has ended is seen before torch collects it (see the module
            # docstring); torch's own poll then reports the rest.
            gone = self._vanished()
            if self.mender.healer.count:
                self._outcome = self._poll_healed(gone)
                return self._outcome
            if gone is None and self.mender.healer.enabled:
                self.mender.refuse_waiting()
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
            self._groups.clear()  # ranks that returned ended their own leftovers
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
        heals = self.mender.healer.count
        if gone is None:
            self.mender.healer.report()
            if self.mender.grower is not None:
                if self._released:
                    self.mender.grower.drop()
                elif self.mender.grow():
                    return None
            self.mender.refuse_waiting()
            if not self._released:
                time.sleep(POLL_S)
                return None
            for ctx in self._contexts():
                _torch_compat.release_returned(ctx)  # torch's wait cannot, for the first
            if any(runs_own_code(p) for p in self._procs.values()):
                time.sleep(POLL_S)
                return None
            self.mender.healer.report(final=True)
            self._groups.clear()  # ranks that returned ended their own leftovers
            self._collect_later()
            world = self._spec.world_size
            return Finished(
                [self._result(r) for r in range(world)],
                heals=heals,
                world_size=self.mender.shrunk(),
            )
        self.mender.healer.report(final=True)
        self._terminate(exclude=gone.rank)
        codes = gone.codes if gone.codes is not None else self._exit_codes()
        self._collect_later()
        if codes is None:  # a rank stuck in the kernel: go by the records alone
            self._stopped = True
            failed = self._failed(None, gone.rank, {}, first=gone.rank)
        else:
            failed = self._ended(gone.rank, codes)
        return dataclasses.replace(failed, heals=heals, world_size=self.mender.shrunk())

    def _contexts(self) -> list[PContext]:
        return [self._ctx, *self.mender.replacements]

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
                if self.mender.healer.count and os.path.exists(failure_path(attempt_dir, rank)):
                    return _Vanished(rank, None)  # torch's first context knows no longer
                if os.path.exists(failure_path(attempt_dir, rank)):
                    # It raised: its peers may be raising too, and write their own records,
                    # or fail in the collective it left; torch stops the rest once it has
                    # collected this one.
                    return _Vanished(rank, exit_status(self._ctx))
                # Died without a word (a signal, os._exit): the others wait for it in a
                # collective; heal it in place, or stop them now.
                if self.mender.healer.enabled and self.mender.heal(returned):
                    return None
                self._terminate(exclude=rank)
                if self.mender.healer.count:
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
            code = self.mender.code(rank)
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
        rank seen to end ``first`` (:func:`._elastic.failed`)."""
        return failed(self._spec, result, early, exited, first)

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
        self.mender.spares.drop()
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
        self.mender.spares.drop()
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
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity else os.cpu_count() or 1
