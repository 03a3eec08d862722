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
from typing import Any, NamedTuple

from nbtools.events._record import Event, decoded_event

__all__ = [
    "BATCH_BYTES",
    "MAX_EVENT_BYTES",
    "Batch",
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

_MAX_HOST_FIELD = 255


class Batch(NamedTuple):
    """One decoded batch: where it came from and what it held.

    Attributes:
        source: ``(host, rank, pid)`` of the writing process.
        dropped: Events that process dropped before this batch (its own count).
        events: The valid events, in the order they were written.
        rejected: Entries of the batch that were not valid events and were left out.
    """

    source: Source
    dropped: int
    events: list[Event]
    rejected: int


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


def decode_batch(line: bytes) -> Batch:
    """Parse one batch line; entries that are not valid events are left out and counted.

    The header must be valid as a whole (it names the source); each event is
    checked on its own (:func:`~nbtools.events._record.decoded_event`), so one
    bad entry costs only itself, as a log daemon drops a bad record and keeps
    the rest of the stream.

    Raises:
        ValueError: the line is not a batch of this format (bad JSON or header).
    """
    try:
        batch = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not an event batch: {line[:120]!r} ({exc})") from None
    if type(batch) is not dict or batch.get("v") != _VERSION:
        version = batch.get("v") if type(batch) is dict else None
        if type(batch) is dict and "v" in batch:
            raise ValueError(f"unknown batch version {version!r}")
        raise ValueError(f"not an event batch: {line[:120]!r}")
    host, pid, rank = batch.get("h"), batch.get("p"), batch.get("r")
    dropped, entries = batch.get("d"), batch.get("e")
    if (
        type(host) is not str
        or len(host) > _MAX_HOST_FIELD
        or type(pid) is not int
        or not (rank is None or type(rank) is int)
        or type(dropped) is not int
        or dropped < 0
        or type(entries) is not list
    ):
        raise ValueError(f"not an event batch (bad header): {line[:120]!r}")
    events = []
    for item in entries:
        event = decoded_event(item, host, pid)
        if event is not None:
            events.append(event)
    return Batch((host, rank, pid), dropped, events, len(entries) - len(events))
