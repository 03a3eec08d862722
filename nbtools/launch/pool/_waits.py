"""What a wait on a pool's ranks ends with, and what watches it.

- the ways a wait ends other than with every rank's answer: :class:`RanksLost`
  (a rank's process ended), :class:`RanksHealed` (the group healed it in place),
  :class:`RanksStuck`, :class:`RanksHung` and :class:`RanksInterrupted`;
- :class:`Watch`, a call's hang and straggler watchdog, started once the call
  has run a moment;
- :class:`Follow`, the stream a command's output is forwarded to (the running cell's).

:mod:`._ranks` waits; :mod:`._restarts` and :mod:`._pool` act on how the wait ended.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from nbtools import _hangs
from nbtools.launch._backend import Failed
from nbtools.launch._watch import FirstSteps

__all__ = [
    "RanksLost",
    "RanksHealed",
    "RanksStuck",
    "RanksHung",
    "RanksInterrupted",
    "Follow",
    "Watch",
    "WATCH_AFTER_S",
    "ranks_text",
]

# A call's watchdog starts once the call has run this long: a call of milliseconds
# (most of a pool's) neither hangs nor straggles, and a thread per call costs a third
# of its time; a longer one loses no more than this of its first progress reports.
WATCH_AFTER_S = 0.25


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


class Follow:
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


class Watch:
    """A call's :class:`nbtools._hangs.Watchdog`, started once the call is past
    :data:`WATCH_AFTER_S` (never when not ``active``: a stop's or interrupt's wait)."""

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
        self._from = time.monotonic() + WATCH_AFTER_S
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


def ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
