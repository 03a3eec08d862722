"""What an event is, and the checks an event passes before it is accepted.

The checks run on the caller's thread, so they are written for speed: exact
type tests first, the slower conversions (NumPy scalars) only when those fail.
Every limit exists so that one encoded event always fits in one atomic pipe
write together with its batch header (see ``_wire``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

__all__ = [
    "Event",
    "check_event",
    "decoded_event",
    "MAX_KIND_CHARS",
    "MAX_MESSAGE_CHARS",
    "MAX_FIELDS",
    "MAX_FIELD_TEXT_CHARS",
    "RESERVED_FIELDS",
]

#: Longest accepted ``kind``.
MAX_KIND_CHARS = 64
#: Messages longer than this are cut (with a trailing ellipsis), never rejected.
MAX_MESSAGE_CHARS = 1000
#: Most fields an event may carry (``step`` and ``rank`` included).
MAX_FIELDS = 16
#: Most characters of field names plus string values of one event.
MAX_FIELD_TEXT_CHARS = 400
#: Names stamped by nbtools itself; a field may not take them.
RESERVED_FIELDS = frozenset({"time", "host", "pid", "kind", "message", "fields"})

_INT_LIMIT = 2**63
_SCALARS = frozenset({str, int, float, bool, type(None)})


class Event(NamedTuple):
    """One event as the kernel keeps it.

    Attributes:
        time: Seconds since the epoch (``time.time()`` of the emitting process).
        host: Host name of the emitting process.
        rank: Global rank of the emitting process, or of the rank the event is about
            (``rank=`` given to ``emit``); None for the kernel and plain scripts.
        pid: Process id of the emitting process.
        kind: What happened, e.g. ``"checkpoint_saved"`` or a user's ``"eval"``.
        message: Human-readable text, or None.
        step: Training step the event belongs to, or None.
        fields: Other named values (numbers, booleans, short strings).
    """

    time: float
    host: str
    rank: int | None
    pid: int
    kind: str
    message: str | None
    step: int | None
    fields: dict[str, Any]


def _numpy_scalar(name: str, value: Any) -> Any:
    """The Python value of a NumPy scalar; TypeError for anything else."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    if isinstance(value, float):  # float subclasses
        return float(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    hint = ""
    if type(value).__module__.startswith("torch"):
        hint = " (pass a Python number, e.g. loss.item())"
    raise TypeError(
        f"event field {name!r} is a {type(value).__name__}; event fields hold numbers, "
        f"booleans, None or short strings{hint}"
    )


def _check_value(name: str, value: Any) -> Any:
    if type(value) not in _SCALARS:
        value = _numpy_scalar(name, value)
        if type(value) not in _SCALARS:  # e.g. a NumPy string scalar
            value = str(value)
    if type(value) is int and not -_INT_LIMIT <= value < _INT_LIMIT:
        raise ValueError(
            f"event field {name!r}={value} does not fit in 64 bits; pass it as a float or a string"
        )
    return value


def _check_int(name: str, value: Any) -> int | None:
    if value is None or type(value) is int:
        return value
    if isinstance(value, bool) or not (isinstance(value, int) or type(value).__module__ == "numpy"):
        raise TypeError(f"event {name} must be an int or None, not {type(value).__name__}")
    converted = _numpy_scalar(name, value)
    if type(converted) is not int:
        raise TypeError(f"event {name} must be an int or None, not {type(value).__name__}")
    return converted


def _cut(message: str) -> str:
    return message[: MAX_MESSAGE_CHARS - 1] + "\u2026"


def check_event(
    kind: Any, message: Any, fields: dict[str, Any]
) -> tuple[str, str | None, int | None, Any, dict[str, Any] | None]:
    """Validate one event; return ``(kind, message, step, rank, fields)``.

    ``rank`` is ``Ellipsis`` when the caller did not give one (the emitting
    process's own rank is stamped then). ``fields`` is None when empty; the
    dict passed in is the caller's ``**kwargs`` and is reused.

    Raises:
        TypeError: ``kind`` or ``message`` is not a string, or a field is not a
            number, boolean, None or string.
        ValueError: ``kind`` is empty or too long, a field name is reserved, or
            the fields hold too much text.
    """
    if type(kind) is not str or not 0 < len(kind) <= MAX_KIND_CHARS or kind.isspace():
        kind = _plain_kind(kind)
    if message is not None:
        if type(message) is not str:
            message = _check_message(message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = _cut(message)
        elif not message:
            message = None
    if not fields:
        return kind, message, None, ..., None
    step = fields.pop("step", None)
    if step is not None and type(step) is not int:
        step = _check_int("step", step)
    rank = fields.pop("rank", ...)
    if rank is not ... and rank is not None and type(rank) is not int:
        rank = _check_int("rank", rank)
    if not fields:
        return kind, message, step, rank, None
    if len(fields) > MAX_FIELDS:
        raise ValueError(
            f"an event carries at most {MAX_FIELDS} fields besides step and rank, got "
            f"{len(fields)}; emit several events or put the rest in the message"
        )
    text = 0
    for name, value in fields.items():
        text += len(name)
        kind_of = type(value)
        if kind_of is float or kind_of is bool or value is None:
            continue
        if kind_of is int and -_INT_LIMIT <= value < _INT_LIMIT:
            continue
        if kind_of is str:
            text += len(value)
            continue
        value = fields[name] = _check_value(name, value)
        if type(value) is str:
            text += len(value)
    if text > MAX_FIELD_TEXT_CHARS or not RESERVED_FIELDS.isdisjoint(fields):
        _explain(fields, text)
    return kind, message, step, rank, fields


def _plain_kind(kind: Any) -> str:
    """``kind`` as a plain str (e.g. from a ``StrEnum``); TypeError/ValueError otherwise."""
    if not isinstance(kind, str):
        raise TypeError(f"event kind must be a str such as 'eval', not {type(kind).__name__}")
    if type(kind) is not str:
        kind = str.__str__(kind)
    if 0 < len(kind) <= MAX_KIND_CHARS and not kind.isspace():
        return kind
    raise ValueError(
        f"event kind must be a non-empty name of at most {MAX_KIND_CHARS} characters, "
        f"got {kind[:80]!r}"
    )


def _check_message(message: Any) -> str:
    if not isinstance(message, str):
        raise TypeError(
            f"event message must be a str or None, not {type(message).__name__}; "
            "put numbers in fields, e.g. emit('eval', value=1.93)"
        )
    return str(message)


def _explain(fields: dict[str, Any], text: int) -> None:
    reserved = sorted(RESERVED_FIELDS.intersection(fields))
    if reserved:
        raise ValueError(
            f"event field name(s) {reserved} are reserved (nbtools stamps time, host and pid "
            "itself); rename them"
        )
    raise ValueError(
        f"event fields hold {text} characters of names and strings, more than "
        f"{MAX_FIELD_TEXT_CHARS}; put long text in the message (cut at {MAX_MESSAGE_CHARS} "
        "characters) or in a file, and the file's path in a field"
    )


def decoded_event(item: Any, host: str, pid: int) -> Event | None:
    """The event a decoded batch entry describes, or None when the entry is not a valid event.

    A batch comes from another process and may come from a writer that is not
    nbtools (anything that can open the pipe), so each entry is checked as
    ``emit`` would have checked it: the kernel keeps only events it can sort,
    prune and draw. ``time`` must be a finite number; ``rank`` and ``step``
    ints or null; ``kind`` a name of at most ``MAX_KIND_CHARS``; ``message`` a
    string or null; ``fields`` an object of scalars.
    """
    if type(item) is not list or len(item) != 6:
        return None
    t, rank, kind, message, step, fields = item
    if type(t) is int:
        t = float(t)
    if type(t) is not float or not math.isfinite(t):
        return None
    if not (rank is None or type(rank) is int) or not (step is None or type(step) is int):
        return None
    if type(kind) is not str or not 0 < len(kind) <= MAX_KIND_CHARS or kind.isspace():
        return None
    if message is not None and (type(message) is not str or len(message) > MAX_MESSAGE_CHARS):
        return None
    if fields is None:
        fields = {}
    elif type(fields) is not dict or len(fields) > MAX_FIELDS + 2:
        return None
    elif not all(type(v) in _SCALARS for v in fields.values()):
        return None
    return Event(t, host, rank, pid, kind, message, step, fields)
