"""What a save tells the run's timeline: the ``checkpoint_saved`` event and its figures."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nbtools import events

__all__ = ["SaveTiming", "saved"]


@dataclass(frozen=True)
class SaveTiming:
    """When a save started and when the training loop got control back.

    ``returned - started`` is what the loop waited for: the whole save when
    synchronous, the staging copy when asynchronous. ``writer`` reports the
    bytes written once the save is published.
    """

    started: float
    returned: float
    writer: Any

    @classmethod
    def now(cls, started: float, writer: Any) -> SaveTiming:
        """The timing of a save that started at ``started`` and returned just now."""
        return cls(started, time.perf_counter(), writer)


def saved(url: str, step: int, timing: SaveTiming | None) -> None:
    """Emit ``checkpoint_saved`` for ``step`` published at ``url``.

    Fields: ``blocked_s`` (the loop waited), ``upload_s`` (background work after
    that, until published) and ``bytes`` (shard data written), when known.
    """
    fields: dict[str, Any] = {}
    if timing is not None:
        fields = {
            "blocked_s": round(timing.returned - timing.started, 4),
            "upload_s": round(max(0.0, time.perf_counter() - timing.returned), 4),
            "bytes": getattr(timing.writer, "saved_bytes", None),
        }
    events.emit("checkpoint_saved", message=f"saved {url}", step=step, **fields)
