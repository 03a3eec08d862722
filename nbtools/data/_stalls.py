"""Input stalls: a batch the training loop waited for much longer than usual.

A :class:`StallWatch` keeps the loader's recent wait times (the first batch of
each iteration left out: it includes starting the workers). A wait is a stall
when it is at least ``MIN_STALL_S`` and ``FACTOR`` times the median of the
recent waits; it is then emitted as an ``input_stall`` event (with the emitting
rank, the seconds waited and the usual wait), which the GPU pane draws as a
shaded span ending when the batch arrived. The common path, a wait under
``MIN_STALL_S``, costs one comparison and one append.
"""

from __future__ import annotations

from collections import deque

from nbtools import events

__all__ = ["StallWatch", "MIN_STALL_S", "FACTOR", "WINDOW", "MIN_HISTORY"]

#: Shortest wait reported as a stall, in seconds.
MIN_STALL_S = 0.5
#: How many times the usual (median) wait a stall is at least.
FACTOR = 10.0
#: Recent waits the median is taken over.
WINDOW = 64
#: Waits seen before any is judged (the usual wait must be known first).
MIN_HISTORY = 3


class StallWatch:
    """Judges each wait of one loader; emits ``input_stall`` for the long ones."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=WINDOW)

    def observe(self, wait: float, first: bool = False) -> bool:
        """Record ``wait`` seconds; True (and an event) when it was a stall.

        Args:
            wait: Seconds the loop waited for the batch.
            first: The first batch of an iteration (recorded nowhere, never a stall).
        """
        if first:
            return False
        recent = self._recent
        stalled = False
        if wait >= MIN_STALL_S and len(recent) >= MIN_HISTORY:
            ordered = sorted(recent)
            usual = ordered[len(ordered) // 2]
            if wait >= FACTOR * usual:
                stalled = True
                events.emit(
                    "input_stall",
                    message=f"waited {wait:.2f} s for a batch (usually {usual:.3f} s)",
                    seconds=round(wait, 3),
                    usual_s=round(usual, 4),
                )
        recent.append(wait)
        return stalled
