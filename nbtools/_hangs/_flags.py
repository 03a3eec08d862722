"""The open flags of a watch, and what they say: lines for the cell, events for the bus.

A :class:`FlagBook` holds the open hang and straggler flags of one group, the
lines the cell is to show (a straggler flag's start and end, a long phase),
and the events the watchdog emits once it released its lock (the bus calls the
watchdog back, so nothing is emitted while it is held). Its times are the
kernel's (monotonic); :meth:`FlagBook.epoch` turns one into the epoch time an
event and the cell show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nbtools._hangs._state import Flag

__all__ = ["FlagBook"]


class FlagBook:
    """Open flags by ``(kind, rank)``, notices for the cell and events not yet emitted.

    Args:
        clock: The kernel's monotonic clock, the one the flags' times are on.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.open: dict[tuple[str, int], Flag] = {}
        self.notices: list[str] = []  # lines for the cell
        self.outbox: list[tuple[str, str, dict[str, Any]]] = []  # events to emit
        self._clock = clock

    def epoch(self, at: float) -> float:
        """The epoch time of a kernel time ``at`` (monotonic), for events and the cell."""
        return time.time() - (self._clock() - at)

    def post(self, kind: str, message: str, **fields: Any) -> None:
        """An event to emit once the watchdog's lock is released."""
        self.outbox.append((kind, message, fields))

    def notice(self, kind: str, message: str, **fields: Any) -> None:
        """A line for the cell that is also an event (posted)."""
        self.notices.append(message)
        self.post(kind, message, **fields)

    def take_posted(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The events posted since the last call (to emit)."""
        posted, self.outbox = self.outbox, []
        return posted

    def take_notices(self) -> list[str]:
        """The lines for the cell since the last call."""
        notices, self.notices = self.notices, []
        return notices

    def end(self, flag: Flag, now: float, how: str) -> None:
        """Post the end of ``flag`` (already out of :attr:`open`); ``how`` says why it ended."""
        lasted = max(0.0, now - flag.since)
        what = "hang" if flag.kind == "hang" else "straggler flag"
        fields: dict[str, Any] = {"score": round(flag.score, 3)} if flag.score is not None else {}
        message = f"rank {flag.rank} on {flag.node}: {what} over after {lasted:.0f} s ({how})"
        if flag.kind == "straggler":
            self.notices.append(message)
        self.post(
            flag.kind,
            message,
            rank=flag.rank,
            node=flag.node,
            since=round(self.epoch(flag.since), 3),
            ended=True,
            lasted_s=round(lasted, 1),
            **fields,
        )
