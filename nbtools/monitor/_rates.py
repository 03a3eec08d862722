"""The live chart's step-rate row: each rank's steps per second, point by point.

The saved picture and the report compute the rates of the whole history at
once (:func:`~nbtools.monitor.timeline.step_rates`); the live chart gets the
same points incrementally, from the progress reports each poll takes from the
pane's :class:`~nbtools.monitor.timeline.EventFeed`, so a poll sends only the
few new points. A rank whose reports stop (hung, stopped) drops to 0 steps/s
once it has been silent for ``SILENT_S`` while others report, as in the picture.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from nbtools.events import Event
from nbtools.monitor.timeline import PROGRESS_KIND, RateWindows

__all__ = ["RateRow", "SILENT_S"]

#: A rank silent this long while others report is drawn at 0 steps/s.
SILENT_S = 5.0


class RateRow:
    """Each rank's step rate over time, built from progress reports as they come.

    Args:
        capacity: Most points kept per rank (the oldest fall out).
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = max(2, capacity)
        self._windows: dict[int, RateWindows] = {}
        self._zero_at: dict[int, float] = {}  # rank -> time of its last 0 point while silent
        self._newest = 0.0
        self.series: dict[int, tuple[deque[float], deque[float | None]]] = {}

    def ranks(self) -> list[int]:
        """Ranks with at least one point, in order."""
        return sorted(self.series)

    def add(self, events: Iterable[Event]) -> list[list[Any]]:
        """Take progress reports; returns the new points ``[rank, epoch ms, steps/s]``."""
        points: list[list[Any]] = []
        for event in events:
            if event.kind != PROGRESS_KIND or event.rank is None:
                continue
            steps = event.fields.get("steps")
            if type(steps) is not int:
                continue
            self._newest = max(self._newest, event.time)
            window = self._windows.setdefault(event.rank, RateWindows())
            self._zero_at.pop(event.rank, None)
            points += self._draw(event.rank, window.add(event.time, steps, event.pid))
        for rank, window in self._windows.items():
            at = window.last[0] if window.last is not None else self._newest
            if self._newest - at <= SILENT_S:
                continue
            points += self._draw(rank, window.flush())  # its last window, cut short
            if rank not in self.series:
                continue
            zero = self._zero_at.get(rank)
            if zero is None:
                points.append(self._point(rank, at, 0.0))
            if zero is None or self._newest - zero >= 1.0:
                points.append(self._point(rank, self._newest, 0.0))
                self._zero_at[rank] = self._newest
        return points

    def _draw(self, rank: int, closed: list[tuple[float, float, float]]) -> list[list[Any]]:
        """Points of the windows just closed: each over its span, a break before a restart."""
        points = []
        for start, end, rate in closed:
            drawn = self.series.get(rank)
            if drawn is not None and drawn[0] and drawn[0][-1] != start:
                points.append(self._point(rank, start, None))  # a break: a restart
            points.append(self._point(rank, start, rate))
            points.append(self._point(rank, end, rate))
        return points

    def _point(self, rank: int, at: float, rate: float | None) -> list[Any]:
        times, values = self.series.setdefault(
            rank, (deque(maxlen=self._capacity), deque(maxlen=self._capacity))
        )
        value = None if rate is None else round(rate, 3)
        times.append(at)
        values.append(value)
        return [rank, round(at * 1000), value]
