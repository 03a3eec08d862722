"""How a pool starts, restarts and gives up: its ranks, one generation after another.

A pool's ranks are one group of the launch backend at a time (a *generation*,
:class:`~nbtools.launch.pool._ranks.Ranks`). Everything that replaces them is
here:

- starting a generation: a group that failed to form before any user code ran
  is formed again by the same loop as a plain call's
  (:func:`nbtools.launch._runner.until_formed`);
- a rank failed and its peers stayed stuck past a short grace, or an
  interrupt left ranks running: fresh ranks, and the user is told that rank
  state was lost;
- a rank died: on local CPU ranks with ``heal`` (the default), the group heals
  in place: the surviving ranks keep their processes and namespaces, a fresh
  process replaces the dead rank, and the user is told which names were lost
  with it (its namespace is new); elsewhere, or where the heal cannot be made,
  fresh ranks. Either counts against ``max_restarts`` since the last requested
  restart; then the pool stops and says how to start it again;
- ``restart()``: fresh ranks on request, also after the pool stopped.

Every replacement emits a ``pool_restarted`` event, every heal a ``healed``
event. A ``keep_alive=True`` call also runs its function again after a
failure, up to its ``max_restarts`` (:mod:`nbtools.launch.pool._kept`); the
ranks under it are replaced here.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError, LaunchError
from nbtools.launch._backend import Failed, GroupSpec, LaunchBackend
from nbtools.launch._failures import RankFailure, describe, from_exit
from nbtools.launch._rank import setup_environment
from nbtools.launch._runner import Plan, until_formed
from nbtools.launch.pool._channel import ChannelClosed, Link, wait_readable
from nbtools.launch.pool._errors import failures_of, first, plural, ranks_text
from nbtools.launch.pool._ranks import HEAL_WAIT_S, INTERRUPT_GRACE_S, PEER_GRACE_S, Ranks
from nbtools.launch.pool._waits import (
    RanksHealed,
    RanksHung,
    RanksInterrupted,
    RanksLost,
    RanksStuck,
)

__all__ = ["Generations", "LOST", "take_healed"]

_log = get_logger("launch")
#: What every replacement of the ranks tells the user.
LOST = "rank state (names, models, tensors) was lost"
# Taking a healed group in: how often the backend is asked whether the group failed while
# the ranks connect again, and how often the channels and the output are looked at.
_GROUP_POLL_S = 0.1
_PUMP_S = 0.02


class Generations:
    """The pool's current ranks and the rules that replace them.

    Args:
        backend: where the ranks run.
        plan: sizes and options of the pool.
        max_restarts: replacements after ranks died before the pool stops (None: no limit).
        run_id: the same for every generation (``TORCHELASTIC_RUN_ID``).
        run_dir: the pool's private directory; each generation gets one inside it.
        collector: the pool's events collector (its environment goes to every rank).
        heal: heal dead ranks in place where the backend can (local CPU ranks).
    """

    def __init__(
        self,
        backend: LaunchBackend,
        plan: Plan,
        max_restarts: int | None,
        run_id: str,
        run_dir: str,
        collector: events.Collector,
        heal: bool = True,
    ) -> None:
        self.heal = heal
        self.backend = backend
        self.plan = plan
        self.max_restarts = max_restarts
        self.run_id = run_id
        self.run_dir = run_dir
        self.collector = collector
        self.ranks: Ranks | None = None
        self.restarts = 0  # every replacement of the ranks, whatever the reason
        self.stopped: str | None = None  # why the pool gave up, after its last restart
        self._deaths = 0  # replacements after ranks died (bounded by max_restarts)
        self._count = 0  # generations started, for their directories

    def live(self) -> Ranks:
        """The running ranks; started now when a restart was interrupted before it ended."""
        if self.ranks is None:
            self.start()
        assert self.ranks is not None
        return self.ranks

    def start(self) -> None:
        """Start a generation and wait until every rank is connected.

        Raises:
            LaunchError: the ranks could not start (their group did not form, again and again).
        """
        outcome = until_formed(self._attempt)
        if isinstance(outcome, Failed):
            text = (
                describe(outcome.failures, outcome.first) if outcome.failures else "the ranks ended"
            )
            raise LaunchError(f"the pool's ranks could not start: {text}")

    def _attempt(self) -> Failed | None:
        attempt_dir = os.path.join(self.run_dir, f"attempt{self._count}")
        self._count += 1
        os.mkdir(attempt_dir)
        spec = GroupSpec(
            payload=b"",
            world_size=self.plan.world_size,
            use_cuda=self.plan.use_cuda,
            run_id=self.run_id,
            restart_count=self.restarts,
            # What is left of max_restarts: each heal in the group uses one more.
            max_restarts=(
                self.restarts + max(0, self.max_restarts - self._deaths)
                if self.max_restarts is not None
                else 2**31 - 1
            ),
            attempt_dir=attempt_dir,
            env={
                **self.collector.environment(),
                **setup_environment(attempt_dir, self.plan.rich_output, self.plan.results_device),
            },
            heal=self.heal,
        )
        try:
            self.ranks = Ranks.start(self.backend, spec, self.plan.output)
        except RanksLost as exc:
            return exc.outcome if exc.outcome is not None else Failed({}, None)
        return None

    # --- what happened during a call, and what it does to the ranks -----------------

    def after_interrupt(self, exc: RanksInterrupted) -> None:
        """An interrupted call: keep ranks that came back to idle, else replace them."""
        if exc.kept:
            _log.warning(
                "interrupted: every rank stopped its work (KeyboardInterrupt there) and is idle "
                "again; the pool and its state were kept"
            )
            return
        note = self.replace("ranks did not stop after an interrupt")
        why = ""
        if not self.backend.interrupts_blocked_calls:
            why = (
                f" (on {self.backend.name} a rank runs your code in an actor thread, which no "
                "signal reaches: an interrupt stops Python code and time.sleep there, but not a "
                "call blocked in a lock, a queue, I/O or C code; such cells can wait in short "
                "steps, e.g. event.wait(0.5) in a loop, or with a timeout)"
            )
        _log.warning(
            "interrupted: rank%s %s did not stop within %.0f s%s; %s",
            plural(exc.pending),
            ranks_text(exc.pending),
            INTERRUPT_GRACE_S,
            why,
            note,
        )

    def after_stuck(self, exc: RanksStuck, localize: Callable[[str], str]) -> DistributedError:
        """A rank failed and its peers did not finish: fresh ranks; the error to raise."""
        failures = failures_of(exc.replies, self.restarts, localize)
        message = describe(failures, first(failures)) + (
            f"\n\nrank{plural(exc.pending)} {ranks_text(exc.pending)} did not finish within "
            f"{PEER_GRACE_S:.0f} s after that (waiting for the failed rank in a "
            "collective?); " + self.replace("ranks stuck after a failure")
        )
        return DistributedError(message, failures)

    def after_hang(self, exc: RanksHung, localize: Callable[[str], str]) -> DistributedError:
        """A hang with ``on_hang="restart"``: the hung ranks are ended and healed in place where
        the pool heals, else fresh ranks; counted as a death; the error."""
        outcome = exc.outcome
        headline = describe(outcome.failures, outcome.first)
        if self.ranks is not None and self.ranks.healer is not None:
            try:
                self.ranks.end_ranks(sorted(outcome.failures), exc.replies)
            except RanksHealed as healed:
                error = self.after_heal(healed, localize, ended=True)
                return DistributedError(f"{headline}\n\n{error}", outcome.failures)
            except RanksLost:
                pass  # not healed: fresh ranks, as without healing
        return self._after_death(outcome.failures, headline, "ranks hung")

    def after_loss(self, exc: RanksLost) -> DistributedError:
        """A rank died: fresh ranks, or the pool stops after too many deaths; the error."""
        outcome = exc.outcome
        if outcome is None or not outcome.failures:
            failures: dict[int, RankFailure] = {}
            headline = "the pool's ranks ended unexpectedly"
        else:
            failures = outcome.failures
            headline = describe(failures, outcome.first, returned=outcome.returned)
        return self._after_death(failures, headline, "a rank died")

    def after_heal(
        self, exc: RanksHealed, localize: Callable[[str], str], ended: bool = False
    ) -> DistributedError:
        """Ranks died and the group heals in place: take the healed ranks in and say what was
        kept and what was lost; the error that ends the call the death interrupted. Where the
        heal does not complete, fresh ranks as after any death. ``ended``: the pool ended the
        dead ranks itself (they hung)."""
        heal = exc.heal
        assert self.ranks is not None
        attempt = self.restarts
        dead = {
            rank: from_exit(rank, _code(heal.how.get(rank, "")), attempt) for rank in heal.ranks
        }
        try:
            kept = take_healed(self.ranks, list(heal.ranks))
        except KeyboardInterrupt:
            # Interrupted halfway through: the next call starts fresh ranks.
            self.discard()
            _log.warning("interrupted while the pool healed in place; %s", LOST)
            raise
        except RanksLost as lost:
            if lost.outcome is None or not lost.outcome.failures:
                lost = RanksLost(Failed(dead, heal.ranks[0]), exc.replies)
            return self.after_loss(lost)
        self._deaths += 1
        self.restarts += 1
        # Said once, by the error that ends the call (and by the event on the time axis).
        message = _healed_line(heal, kept, time.time() - heal.seen, ended)
        names = sorted({name for names in kept.values() for name in names})
        events.emit(
            "healed",
            message,
            pool=True,
            rank=heal.ranks[0],
            ranks=",".join(str(r) for r in heal.ranks),
            kept=",".join(str(r) for r in sorted(kept)),
            lost=",".join(names),
            restarts=self.restarts,
        )
        failures = {**failures_of(exc.replies, attempt, localize), **dead}
        return DistributedError(
            f"{message}\n\nthe call was cut short by the death: run it again", failures
        )

    def _after_death(
        self, failures: dict[int, RankFailure], headline: str, reason: str
    ) -> DistributedError:
        self._deaths += 1
        if self.max_restarts is not None and self._deaths > self.max_restarts:
            self.stopped = (
                f"the pool stopped after its ranks died {self._deaths} times "
                f"(max_restarts={self.max_restarts})"
            )
            self.discard()
            note = (
                self.stopped + "; call pool.restart() (%distributed restart) to start fresh ranks"
            )
            events.emit("failure", headline.splitlines()[0], pool=True)
        else:
            note = self.replace(reason)
        return DistributedError(f"{headline}\n\n{note}", failures)

    # --- replacing ----------------------------------------------------------------------

    def restart(self) -> None:
        """Fresh ranks on request (state lost); also after the pool stopped."""
        self.stopped = None
        self._deaths = 0
        self.replace("restart requested", graceful=True)
        _log.warning("the pool restarted %d fresh ranks: %s", self.plan.world_size, LOST)

    def replace(self, reason: str, graceful: bool = False) -> str:
        """Start fresh ranks in place of the current ones; the sentence that tells the user."""
        self.discard(graceful)
        self.restarts += 1
        events.emit(
            "pool_restarted",
            f"{reason}; {LOST}",
            reason=reason,
            restarts=self.restarts,
            world_size=self.plan.world_size,
        )
        self.start()
        return f"the pool restarted with {self.plan.world_size} fresh ranks: {LOST}"

    def discard(self, graceful: bool = False) -> None:
        """End the current ranks (asked to stop, or killed); what they sent is collected."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            if graceful:
                ranks.stop()
            else:
                ranks.kill()
        self.collector.drain()

    def close(self, graceful: bool) -> None:
        """End the ranks for good and release the backend, events and directory."""
        ranks, self.ranks = self.ranks, None
        try:
            if ranks is not None:
                if graceful:
                    ranks.stop()
                else:
                    ranks.kill()  # a call is running in another thread: it ends with an error
        finally:
            release(self.backend, self.collector, self.run_dir)


def _code(how: str) -> int | None:
    """The exit code a heal's ``how`` names (``"SIGKILL"``, ``"exit code 3"``)."""
    if how.startswith("SIG"):
        try:
            return -int(signal.Signals[how])
        except KeyError:
            return None
    if how.startswith("exit code "):
        return int(how[len("exit code ") :])
    return None


def _healed_line(heal: Any, kept: dict[int, list[str]], took: float, ended: bool = False) -> str:
    """The line a heal in place shows in the cell: who died, who kept what, what was lost."""
    how = "was ended" if ended else "died"
    died = " and ".join(f"rank {r} {how} ({heal.how.get(r, 'no exit code')})" for r in heal.ranks)
    survivors = sorted(kept)
    who = f"rank{plural(survivors)} {ranks_text(survivors)}"
    verb = "kept their processes and names" if len(survivors) > 1 else "kept its process and names"
    replaced = f"rank{plural(heal.ranks)} {ranks_text(heal.ranks)}"
    names = sorted({name for names in kept.values() for name in names})
    if names:
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        new = "its namespace is" if len(heal.ranks) == 1 else "their namespaces are"
        lost = f"; the names lost there ({new} new): {shown}"
    else:
        lost = "; no names were lost"
    return f"{died}; healed in {took:.1f} s: {who} {verb}, {replaced} replaced{lost}"


def release(backend: LaunchBackend, collector: events.Collector, run_dir: str) -> None:
    """Release what a pool holds besides its ranks; safe on a pool that never started."""
    try:
        collector.stop()
        backend.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def take_healed(
    ranks: Ranks, replaced: list[int], wait: float = HEAL_WAIT_S
) -> dict[int, list[str]]:
    """Take the healed group of ``ranks`` in: the surviving ranks form the group again with the
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
    old = ranks.links
    ranks.links, ranks.hellos = {}, {}
    cut_short = ranks.seq  # the call the death cut short: its user code is interrupted
    ranks.seq += 1
    survivors = [rank for rank in old if rank not in replaced]
    closing: dict[int, Link] = {}
    for rank in survivors:
        try:
            old[rank].send((cut_short, "interrupt", None))
            old[rank].send((ranks.seq, "heal", None))
            closing[rank] = old[rank]
        except (ChannelClosed, OSError):
            old[rank].close()
    for rank in replaced:
        old[rank].close()
    deadline = time.monotonic() + wait
    next_poll = 0.0
    try:
        while closing or len(ranks.links) < ranks.world_size:
            if time.monotonic() > deadline:
                raise RanksLost(None, {})
            wait_readable(list(closing.values()), ranks.listener, _PUMP_S)
            for rank, link in list(closing.items()):
                try:
                    link.frames()  # what it answered before it healed: the call is over
                except ChannelClosed:
                    link.close()
                    del closing[rank]
            ranks.accept()
            ranks.forwarder.poll()
            if time.monotonic() >= next_poll:
                outcome = ranks.group.poll()
                if outcome is not None:
                    raise RanksLost(outcome if isinstance(outcome, Failed) else None, {})
                if ranks.healer is not None and ranks.healer.count > ranks.heals_taken:
                    raise RanksLost(None, {})  # a second heal before the first was over
                next_poll = time.monotonic() + _GROUP_POLL_S
    finally:
        for link in closing.values():
            link.close()
    ranks.forwarder.poll(final=True)
    return {rank: list(ranks.hellos[rank].get("names", ())) for rank in survivors}
