"""The bytes on the channel: one batch of events is one line of JSON.

A batch is written with a single ``write`` of at most ``PIPE_BUF`` bytes, which
POSIX makes atomic on a pipe: batches from many processes never interleave,
and the reader splits the stream on newlines. JSON strings escape newlines, so
a newline only ever ends a batch.

    {"v":1,"h":"node1","p":4242,"r":0,"d":3,"e":[[time,rank,kind,message,step,fields],...]}

``d`` is the number of events this process dropped since its previous
delivered batch; ``r`` is the process's own rank (None outside a run).
"""

from __future__ import annotations

import json
import select
from typing import Any

from nbtools.events._record import Event

__all__ = [
    "BATCH_BYTES",
    "MAX_EVENT_BYTES",
    "Record",
    "Source",
    "batch_prefix",
    "BATCH_SUFFIX",
    "encode_event",
    "decode_batch",
]

#: A write of at most this many bytes to a pipe is atomic.
BATCH_BYTES = min(getattr(select, "PIPE_BUF", 4096), 4096)
_VERSION = 1
_MAX_HOST_CHARS = 64
# Room for the header: a 64-character host name escaped at worst plus four numbers.
_HEADER_ROOM = 512
#: Largest encoded event; any one event fits in a batch with its header.
MAX_EVENT_BYTES = BATCH_BYTES - _HEADER_ROOM
BATCH_SUFFIX = b"]}\n"

#: An event before it is stamped with host and pid: (time, rank, kind, message, step, fields).
Record = tuple[float, "int | None", str, "str | None", "int | None", "dict[str, Any] | None"]
#: Where a batch came from: (host, rank, pid).
Source = tuple[str, "int | None", int]

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def batch_prefix(host: str, pid: int, rank: int | None, dropped: int) -> bytes:
    """The start of a batch line, up to the opening bracket of its event list."""
    head = _dumps({"v": _VERSION, "h": host[:_MAX_HOST_CHARS], "p": pid, "r": rank, "d": dropped})
    return head[:-1].encode() + b',"e":['


def encode_event(record: Record) -> bytes:
    """One event as JSON, cut to at most ``MAX_EVENT_BYTES`` (the message goes first)."""
    data = _dumps(record).encode()
    if len(data) <= MAX_EVENT_BYTES:
        return data
    t, rank, kind, message, step, fields = record
    if message:
        # The longest prefix of the message that fits (escapes make bytes per character vary).
        lo, hi, best = 0, len(message) - 1, None
        while lo <= hi:
            keep = (lo + hi) // 2
            cut = message[:keep] + "\u2026" if keep else None
            candidate = _dumps((t, rank, kind, cut, step, fields)).encode()
            if len(candidate) <= MAX_EVENT_BYTES:
                best, lo = candidate, keep + 1
            else:
                hi = keep - 1
        if best is not None:
            return best
    # Only reachable by bypassing the checks of ``emit``: keep what identifies the event.
    return _dumps((t, rank, kind[:64], None, step, {"truncated": True})).encode()


def decode_batch(line: bytes) -> tuple[Source, int, list[Event]]:
    """Parse one batch line into its source, its dropped count and its events.

    Raises:
        ValueError: the line is not a batch of this format.
    """
    try:
        batch = json.loads(line)
        if batch.get("v") != _VERSION:
            raise ValueError(f"unknown batch version {batch.get('v')!r}")
        host, pid, rank, dropped = batch["h"], batch["p"], batch["r"], int(batch["d"])
        events = [
            Event(t, host, r, pid, kind, message, step, fields or {})
            for t, r, kind, message, step, fields in batch["e"]
        ]
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not an event batch: {line[:120]!r} ({exc})") from None
    return (host, rank, pid), dropped, events
