"""One generation of a pool's ranks: started, commanded, watched and stopped.

The ranks are an ordinary group of the launch backend
(:mod:`nbtools.launch._backend`) whose function is the pool's command loop
(:func:`nbtools.launch.pool._rank.serve`): there is no second launcher. This
module adds the kernel's side of the command channel and the rules for
waiting on a command:

- Every rank answers: the answers are returned, failures included.
- A rank's process ends (signal, ``os._exit``, OOM): :class:`RanksLost`.
- A rank failed while others are still running (likely waiting for it in a
  collective): after :data:`PEER_GRACE_S`, :class:`RanksStuck`.
- The kernel is interrupted: every rank is interrupted (``KeyboardInterrupt``
  in its user code); :class:`RanksInterrupted` says whether all of them came
  back to idle within :data:`INTERRUPT_GRACE_S`.

Output is forwarded by the waiting thread itself, so every line a command
prints reaches the cell that runs the command, before the call returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import cloudpickle

from nbtools import _hangs
from nbtools._internal.log import get_logger
from nbtools.launch._backend import Failed, Finished, GroupSpec, LaunchBackend, RankGroup
from nbtools.launch._output import OutputForwarder
from nbtools.launch._rank import KERNEL_LOGGING_ENV, describe_kernel_logging
from nbtools.launch._runner import report_leftovers
from nbtools.launch._watch import FirstSteps, HangPolicy
from nbtools.launch.pool._channel import ChannelClosed, Link, Listener, frame, wait_readable
from nbtools.launch.pool._rank import OK, serve

__all__ = [
    "Ranks",
    "RanksHung",
    "RanksLost",
    "RanksHealed",
    "HEAL_WAIT_S",
    "RanksStuck",
    "RanksInterrupted",
    "PEER_GRACE_S",
    "INTERRUPT_GRACE_S",
]

_log = get_logger("launch")

#: How long ranks may keep running after a peer failed before the pool is restarted.
PEER_GRACE_S = 3.0
#: How long interrupted ranks have to come back to idle before they are restarted.
INTERRUPT_GRACE_S = 5.0
#: How long a heal in place may take (survivors done with their call, the replacement
#: started and every rank connected again) before the pool starts fresh ranks instead.
HEAL_WAIT_S = 60.0
# How often the backend is asked whether a rank has died while waiting.
_GROUP_POLL_S = 0.1
# A call's watchdog starts once the call has run this long: a call of milliseconds
# (most of a pool's) neither hangs nor straggles, and a thread per call costs a third
# of its time; a longer one loses no more than this of its first progress reports.
_WATCH_AFTER_S = 0.25
# How often output is forwarded while a command runs (the forwarder's own pace).
_PUMP_S = 0.02
# A rank whose channel closed: how long its death may take to reach the backend.
_DEATH_WAIT_S = 10.0
# Stopping: how long ranks have to acknowledge and end by themselves.
_STOP_WAIT_S = 10.0
# Ranks elsewhere ship their output asynchronously: let it arrive before returning.
_REMOTE_SETTLE_S = 0.3


class RanksLost(Exception):
    """A rank's process ended; ``outcome`` is the backend's account of it (None if unknown)."""

    def __init__(self, outcome: Failed | None, replies: dict[int, tuple[str, Any]]) -> None:
        super().__init__("ranks lost")
        self.outcome = outcome
        self.replies = replies


class RanksHealed(RanksLost):
    """Ranks died and the group healed in place: ``heal`` says which (see :meth:`Ranks.heal`)."""

    def __init__(self, heal: Any, replies: dict[int, tuple[str, Any]]) -> None:
        super().__init__(None, replies)
        self.heal = heal  # the backend's record of it (``nbtools.launch._local._heal.Heal``)


class RanksStuck(Exception):
    """Some ranks failed and others did not finish within the grace period."""

    def __init__(self, replies: dict[int, tuple[str, Any]], pending: list[int]) -> None:
        super().__init__("ranks stuck")
        self.replies = replies
        self.pending = pending


class RanksHung(Exception):
    """A hang was reported during a call whose pool restarts on hangs (``on_hang="restart"``)."""

    def __init__(self, outcome: Failed, replies: dict[int, tuple[str, Any]]) -> None:
        super().__init__("ranks hung")
        self.outcome = outcome  # the hang as the failure of its culprits (``HangPolicy``)
        self.replies = replies


class RanksInterrupted(Exception):
    """The call was interrupted; ``kept`` when every rank came back to idle."""

    def __init__(self, kept: bool, replies: dict[int, tuple[str, Any]], pending: list[int]) -> None:
        super().__init__("interrupted")
        self.kept = kept
        self.replies = replies
        self.pending = pending


class _Follow:
    """A stream that writes to whatever ``sys.<name>`` is at the time: the running cell's."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()

    def isatty(self) -> bool:
        try:
            return bool(getattr(sys, self.name).isatty())
        except (AttributeError, ValueError):
            return False


class Ranks:
    """The running ranks of one pool generation; made by :meth:`start`."""

    def __init__(
        self,
        group: RankGroup,
        forwarder: OutputForwarder,
        listener: Listener,
        world_size: int,
        remote: bool,
    ) -> None:
        self.group = group
        self.forwarder = forwarder
        self.listener = listener
        self.world_size = world_size
        self.remote = remote
        self.links: dict[int, Link] = {}
        self.hellos: dict[int, dict] = {}
        self._seq = 0
        self._ended = False
        self._wrote = False  # whether a rank wrote output during the current command
        self._next_check = 0.0  # when a long write next looks at the ranks
        self.first_steps = FirstSteps()  # the start-up bound learned carries across calls
        # The backend's healer where the group heals dead ranks in place (local CPU ranks):
        # the pool says each heal itself, naming the names lost with the replaced ranks.
        self.healer: Any = getattr(group, "healer", None)
        if self.healer is not None and not self.healer.enabled:
            self.healer = None
        if self.healer is not None:
            self.healer.announce = False
        self._heals = 0  # heals of the group this pool has taken in
        #: The kernel's logging as these ranks have it (``describe_kernel_logging()``).
        self.logging = ""

    @classmethod
    def start(
        cls,
        backend: LaunchBackend,
        spec: GroupSpec,
        output: str,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> Ranks:
        """Start ``spec.world_size`` ranks serving commands; return once all are connected.

        ``spec.payload`` is ignored: the payload is the command loop.

        Raises:
            RanksLost: a rank failed before it could connect.
            KeyboardInterrupt: interrupted; what started is stopped.
        """
        remote = backend.remote_nodes
        listener = (
            Listener(spec.world_size, host=_driver_address())
            if remote
            else Listener(spec.world_size, directory=spec.attempt_dir)
        )
        kernel_pid = None if remote else os.getpid()  # whose memory files large pushes use
        payload = cloudpickle.dumps(
            (serve, (listener.address, listener.key, spec.use_cuda, kernel_pid), {})
        )
        spec = GroupSpec(
            payload,
            spec.world_size,
            spec.use_cuda,
            spec.run_id,
            spec.restart_count,
            spec.max_restarts,
            spec.attempt_dir,
            spec.env,
            heal=spec.heal,
        )
        try:
            group = backend.start(spec)
        except BaseException:
            listener.close()
            raise
        forwarder = OutputForwarder(
            group.stdouts,
            group.stderrs,
            output,
            stdout or _Follow("stdout"),
            stderr or _Follow("stderr"),
        )
        ranks = cls(group, forwarder, listener, spec.world_size, remote)
        ranks.logging = spec.env.get(KERNEL_LOGGING_ENV, "")
        try:
            ranks._connect()
        except BaseException:
            ranks.kill()
            raise
        return ranks

    @property
    def pids(self) -> list[int]:
        return [self.hellos[r]["pid"] for r in range(self.world_size)]

    def _accept(self) -> None:
        """Take the ranks' new connections; a second one for a rank already in is refused."""
        for link, hello in self.listener.poll():
            if link.rank in self.links:  # holds the key, yet a rank already in: not ours
                _log.warning("a second connection for rank %d was refused", link.rank)
                link.close()
                continue
            self.links[link.rank] = link
            self.hellos[link.rank] = hello

    def _connect(self) -> None:
        next_poll = 0.0
        while len(self.links) < self.world_size:
            wait_readable([], self.listener, _PUMP_S)
            self._accept()
            self.forwarder.poll()
            if time.monotonic() >= next_poll:
                outcome = self.group.poll()
                if outcome is not None:
                    raise RanksLost(outcome if isinstance(outcome, Failed) else None, {})
                next_poll = time.monotonic() + _GROUP_POLL_S
        if self.healer is None:
            self.listener.close()  # every rank is in: nothing more may connect
        self.forwarder.poll(final=True)

    # --- commands --------------------------------------------------------------------

    def call(
        self,
        op: str,
        arg: Any,
        hang_timeout: float | None = None,
        setup: dict[str, Any] | None = None,
        on_hang: str = "report",
    ) -> dict[int, tuple]:
        """Send one command to every rank; every rank's ``(kind, data)`` answer.

        ``setup`` is applied by each rank before the command runs (``{"logging":
        ...}``: the kernel's logging configuration, see :meth:`call_setup`).

        Raises:
            RanksLost, RanksStuck, RanksInterrupted: see the module docstring.
            RanksHung: a hang was reported and ``on_hang`` is ``"restart"``.
        """
        self._seq += 1
        seq = self._seq
        self._wrote = False
        data = frame((seq, op, arg, setup))
        replies: dict[int, tuple] = {}
        try:
            for link in self.links.values():
                link.send_frame(data, self._while_sending)
            self._gather(seq, replies, hang_timeout=hang_timeout, on_hang=on_hang)
        except KeyboardInterrupt:
            self._interrupted(seq, replies)
        except ChannelClosed:
            raise RanksLost(self._death(replies), replies) from None
        self._settle()
        return replies

    def call_setup(self) -> dict[str, Any] | None:
        """What the next call must bring the ranks up to date with: the kernel's logging
        when it changed since they last got it (else None: nothing to send)."""
        described = describe_kernel_logging()
        if described == self.logging:
            return None
        self.logging = described
        return {"logging": described}

    def _while_sending(self) -> None:
        """While a rank is slow to take a big frame: forward output, notice a death."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _GROUP_POLL_S
        self.forwarder.poll()
        outcome = self.group.poll()
        if outcome is not None:
            raise RanksLost(outcome if isinstance(outcome, Failed) else None, {})
        self._check_heal({})

    def _interrupted(self, seq: int, replies: dict[int, tuple]) -> None:
        pending = sorted(set(self.links) - set(replies))
        for rank in pending:
            with contextlib.suppress(ChannelClosed, OSError):
                self.links[rank].send((seq, "interrupt", None))
        try:
            self._gather(seq, replies, deadline=time.monotonic() + INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pass  # interrupted again: do not wait any longer
        except (RanksLost, RanksStuck, ChannelClosed):
            pass
        pending = sorted(set(self.links) - set(replies))
        if pending:
            _log.warning(
                "interrupted: rank%s %s did not stop within %.0f s; the Python stack of every "
                "rank follows",
                "s" if len(pending) > 1 else "",
                _ranks_text(pending),
                INTERRUPT_GRACE_S,
            )
            with contextlib.suppress(KeyboardInterrupt):
                self.group.show_stacks(self._pumped)
        self._settle()
        raise RanksInterrupted(not pending, replies, pending)

    def _gather(
        self,
        seq: int,
        replies: dict[int, tuple],
        *,
        deadline: float | None = None,
        hang_timeout: float | None = None,
        on_hang: str = "report",
    ) -> None:
        # Hangs are judged from the ranks' progress reports while a call runs.
        watch = _Watch(
            len(self.links),
            hang_timeout,
            active=deadline is None,
            known=self.hellos,
            localize=self.forwarder.localize,
            first_steps=self.first_steps,
        )
        try:
            self._gather_replies(seq, replies, watch, deadline, hang_timeout, on_hang)
        finally:
            watch.stop()

    def _gather_replies(
        self,
        seq: int,
        replies: dict[int, tuple],
        watch: _Watch,
        deadline: float | None,
        hang_timeout: float | None,
        on_hang: str = "report",
    ) -> None:
        started = time.monotonic()
        next_poll = started + _GROUP_POLL_S
        failed_at: float | None = None
        policy = HangPolicy(on_hang, hang_timeout)
        lost = False
        while len(replies) < len(self.links):
            pending = [link for rank, link in self.links.items() if rank not in replies]
            if not lost:
                wait_readable(pending, None, _PUMP_S)
            for link in pending:
                try:
                    messages = link.frames()
                except ChannelClosed:
                    lost = True
                    continue
                for message in messages:
                    if message[0] == seq:
                        replies[link.rank] = (message[1], message[2])
                        self._wrote = self._wrote or message[3]
                        if message[1] != OK and failed_at is None:
                            failed_at = time.monotonic()
            now = time.monotonic()
            self.forwarder.poll()
            if len(replies) == len(self.links):
                break
            if lost:
                raise RanksLost(self._death(replies), replies)
            if now >= next_poll:
                outcome = self.group.poll()
                if outcome is not None:
                    raise RanksLost(outcome if isinstance(outcome, Failed) else None, replies)
                self._check_heal(replies)
                next_poll = time.monotonic() + _GROUP_POLL_S
            if deadline is not None and now >= deadline:
                return
            if failed_at is not None and now - failed_at > PEER_GRACE_S:
                raise RanksStuck(replies, sorted(set(self.links) - set(replies)))
            quiet = now - max(started, self.forwarder.last_output)
            hung = policy.look(watch.due(now), quiet, lambda: self.group.show_stacks(self._pumped))
            if hung is not None:
                raise RanksHung(hung, replies)

    def _death(self, replies: dict[int, tuple] | None = None) -> Failed | None:
        """The backend's account of the rank that closed its channel.

        Raises:
            RanksHealed: the group healed the dead ranks in place (:meth:`heal` goes on).
        """
        deadline = time.monotonic() + _DEATH_WAIT_S
        while time.monotonic() < deadline:
            self.forwarder.poll()
            outcome = self.group.poll()
            if isinstance(outcome, Failed):
                return outcome
            if isinstance(outcome, Finished):
                return None
            self._check_heal(replies or {})
        return None

    def _check_heal(self, replies: dict[int, tuple]) -> None:
        """Raise :class:`RanksHealed` once the group has started healing dead ranks."""
        if self.healer is not None and self.healer.count > self._heals:
            self._heals = self.healer.count
            raise RanksHealed(self.healer.heals[-1], replies)

    # --- healing in place ------------------------------------------------------------

    def end_ranks(self, ranks: list[int], replies: dict[int, tuple]) -> None:
        """End ``ranks`` (hung) with SIGKILL, so that the group heals them in place.

        Raises:
            RanksHealed: the group heals them (:meth:`heal` goes on).
            RanksLost: it did not (the pool then starts fresh ranks).
        """
        for rank in ranks:
            pid = self.hellos.get(rank, {}).get("pid")
            if pid is None or self.remote:
                continue
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        raise RanksLost(self._death(replies), replies)

    def heal(self, replaced: list[int], wait: float = HEAL_WAIT_S) -> dict[int, list[str]]:
        """Take the healed group in: the surviving ranks form the group again with the
        replacements (their processes and namespaces kept), and every rank connects anew.

        Each survivor is told to heal; the call the death cut short is interrupted where it
        still runs there (``KeyboardInterrupt``; its collectives with the dead rank fail
        anyway), then it leaves its group and its channel, joins the next generation of the
        group and connects again, with the names its namespace kept.

        Returns:
            The names each surviving rank kept, by rank.

        Raises:
            RanksLost: the group did not heal within ``wait`` seconds, or failed meanwhile
                (the pool then starts fresh ranks).
        """
        old = self.links
        self.links, self.hellos = {}, {}
        cut_short = self._seq  # the call the death cut short: its user code is interrupted
        self._seq += 1
        survivors = [rank for rank in old if rank not in replaced]
        closing: dict[int, Link] = {}
        for rank in survivors:
            try:
                old[rank].send((cut_short, "interrupt", None))
                old[rank].send((self._seq, "heal", None))
                closing[rank] = old[rank]
            except (ChannelClosed, OSError):
                old[rank].close()
        for rank in replaced:
            old[rank].close()
        deadline = time.monotonic() + wait
        next_poll = 0.0
        try:
            while closing or len(self.links) < self.world_size:
                if time.monotonic() > deadline:
                    raise RanksLost(None, {})
                wait_readable(list(closing.values()), self.listener, _PUMP_S)
                for rank, link in list(closing.items()):
                    try:
                        link.frames()  # what it answered before it healed: the call is over
                    except ChannelClosed:
                        link.close()
                        del closing[rank]
                self._accept()
                self.forwarder.poll()
                if time.monotonic() >= next_poll:
                    outcome = self.group.poll()
                    if outcome is not None:
                        raise RanksLost(outcome if isinstance(outcome, Failed) else None, {})
                    if self.healer is not None and self.healer.count > self._heals:
                        raise RanksLost(None, {})  # a second heal before the first was over
                    next_poll = time.monotonic() + _GROUP_POLL_S
        finally:
            for link in closing.values():
                link.close()
        self.forwarder.poll(final=True)
        return {rank: list(self.hellos[rank].get("names", ())) for rank in survivors}

    def _pumped(self) -> float:
        self.forwarder.poll()
        return self.forwarder.last_output

    def _settle(self) -> None:
        if self.remote and self._wrote:
            # The output of ranks elsewhere is shipped here on its own: wait until it
            # arrived (output seen, then a quiet moment) or the settle time is over.
            asked = time.monotonic()
            end = asked + _REMOTE_SETTLE_S
            while time.monotonic() < end:
                self.forwarder.poll()
                seen = self.forwarder.last_output
                if seen > asked and time.monotonic() - seen > 2 * _PUMP_S:
                    break
                time.sleep(_PUMP_S)
        self.forwarder.poll(final=True)

    # --- ending ----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every rank to stop and wait for them to end; stop them by force if need be."""
        if self._ended:
            return
        try:
            self._seq += 1
            seq = self._seq
            replies: dict[int, tuple] = {}
            with contextlib.suppress(ChannelClosed, OSError, RanksLost, RanksStuck):
                for link in self.links.values():
                    link.send((seq, "stop", None))
                self._gather(seq, replies, deadline=time.monotonic() + _STOP_WAIT_S)
            deadline = time.monotonic() + _STOP_WAIT_S
            while time.monotonic() < deadline:
                self.forwarder.poll()
                if self.group.poll() is not None:
                    break
        finally:
            self.kill()

    def kill(self) -> None:
        """Stop every rank now and release everything; idempotent."""
        if self._ended:
            return
        self._ended = True
        try:
            try:
                self.group.stop()
            finally:
                left = self.group.close()
                report_leftovers(left)
        finally:
            for link in self.links.values():
                link.close()
            self.listener.close()
            with contextlib.suppress(OSError, ValueError):
                self.forwarder.poll(final=True)
            self.forwarder.stop()


def _driver_address() -> str:
    """The address ranks on other nodes reach this process at (Ray's view of this node)."""
    import ray

    return ray.util.get_node_ip_address()


class _Watch:
    """A call's :class:`nbtools._hangs.Watchdog`, started once the call is past
    :data:`_WATCH_AFTER_S` (never when not ``active``: a stop's or interrupt's wait)."""

    def __init__(
        self,
        world_size: int,
        hang_timeout: float | None,
        active: bool,
        known: dict[int, dict[str, Any]] | None = None,
        localize: Callable[[str], str] | None = None,
        first_steps: FirstSteps | None = None,
    ) -> None:
        self._world_size = world_size
        self._first_steps = first_steps  # the pool's: what its earlier calls' first steps took
        self._known = known or {}  # rank -> its hello: the watchdog samples it at once
        self._localize = localize  # names frames of code sent by value as the caller knows them
        self._hang_timeout = hang_timeout
        self._active = active
        self._from = time.monotonic() + _WATCH_AFTER_S
        self._dog: _hangs.Watchdog | None = None

    def due(self, now: float) -> _hangs.Watchdog | None:
        """The watchdog, started now if the call has run long enough; None before."""
        if self._dog is None and self._active and now >= self._from:
            self._dog = _hangs.Watchdog(
                self._world_size,
                hang_timeout=self._hang_timeout,
                localize=self._localize,
                first_steps=self._first_steps,
            )
            for rank, hello in self._known.items():
                self._dog.know(rank, int(hello["pid"]), str(hello.get("host", "")))
            self._dog.start()
        return self._dog

    def stop(self) -> None:
        if self._dog is not None:
            self._dog.stop()


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
