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
import time
from typing import Any, TextIO

import cloudpickle

from nbtools._internal.log import get_logger
from nbtools.launch._backend import Failed, Finished, GroupSpec, LaunchBackend, RankGroup
from nbtools.launch._output import OutputForwarder
from nbtools.launch._rank import KERNEL_LOGGING_ENV, describe_kernel_logging
from nbtools.launch._runner import report_leftovers
from nbtools.launch._watch import FirstSteps, HangPolicy
from nbtools.launch.pool._channel import ChannelClosed, Link, Listener, frame, wait_readable
from nbtools.launch.pool._rank import OK, serve
from nbtools.launch.pool._waits import (
    Follow,
    RanksHealed,
    RanksHung,
    RanksInterrupted,
    RanksLost,
    RanksStuck,
    Watch,
    ranks_text,
)

__all__ = ["Ranks", "HEAL_WAIT_S", "PEER_GRACE_S", "INTERRUPT_GRACE_S"]

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
# How often output is forwarded while a command runs (the forwarder's own pace).
_PUMP_S = 0.02
# A rank whose channel closed: how long its death may take to reach the backend.
_DEATH_WAIT_S = 10.0
# Stopping: how long ranks have to acknowledge and end by themselves.
_STOP_WAIT_S = 10.0
# Ranks elsewhere ship their output asynchronously: let it arrive before returning.
_REMOTE_SETTLE_S = 0.3


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
        self.seq = 0
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
        self.heals_taken = 0  # heals of the group this pool has taken in
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
            stdout or Follow("stdout"),
            stderr or Follow("stderr"),
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

    def accept(self) -> None:
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
            self.accept()
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
        self.seq += 1
        seq = self.seq
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
                ranks_text(pending),
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
        watch = Watch(
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
        watch: Watch,
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
        if self.healer is not None and self.healer.count > self.heals_taken:
            self.heals_taken = self.healer.count
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
            self.seq += 1
            seq = self.seq
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
