"""The pane's view of the run's events: what is drawn, how, and how little is sent.

Events come from :mod:`nbtools.events` (every rank's ``emit`` reaches the
kernel's bus). :class:`EventFeed` subscribes to a bus and queues new events on
the thread that delivers them (the collector's reader): appending to a bounded
queue is all it does there. The pane's chart takes the queued events with each
poll, encoded as short rows, so events ride in the same small per-poll message
as the samples and the per-poll budget holds; while polling is paused nothing
is sent and the queues keep the events (bounded) until the pane resumes.

How each kind is drawn on the shared time axis (:func:`category`):

- ``"save"``: a band for the seconds a checkpoint save blocked the loop
  (``checkpoint_saved`` with ``blocked_s``; the band ends ``upload_s`` before
  the event, which is stamped when the upload finished);
- ``"stall"``: a shaded span for the seconds a rank waited for input
  (``input_stall`` with ``seconds``);
- ``"failure"`` and ``"restart"``: a vertical line (``rank_failed``,
  ``failure``, a GPU's XID error ``gpu_xid`` or its loss ``gpu_lost``;
  ``restart``, ``pool_restarted``);
- ``"restore"``: a band for the seconds a restore took (``checkpoint_restored``
  with ``seconds``), ending when the state was back;
- ``"run"``: a thin line where a launch started or finished;
- ``"world"``: a line where the run went on with fewer processes (``shrunk``)
  or grew back (``grew``); the row of the world size (:func:`world_sizes`) steps there;
- ``"phase"``: a line where a named part of the work begins (``phase``, with
  the name as its message: ``events.emit("phase", "fine-tuning")``); the
  report writes the name beside it;
- ``"hang"`` and ``"straggler"``: a flagged rank (``hang``, ``straggler``):
  a band from ``since`` (where the rank stopped or slowed) to when it was
  flagged, and another to when the flag ended (``ended=True``);
- ``"mark"``: a marker for anything else, user events included.

The ranks' ``progress`` reports are not events to draw one by one: they
make the per-rank step-rate row (:func:`step_rates`). The launches, shrinks
and growths make the row of the run's world size (:func:`world_sizes`), drawn
only once the size changed: a run that kept its size has no news for a row.

Every event also gets a marker whose hover text gives its details.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nbtools import events as _events
from nbtools.events import Bus, Event

__all__ = [
    "EventFeed",
    "category",
    "encode",
    "event_rows",
    "EVENT_COLUMNS",
    "CATEGORY_LABELS",
    "PROGRESS_KIND",
    "RANK_GPU_KIND",
    "announce_rank_gpu",
    "gpu_ranks",
    "same_device",
    "drawn",
    "MIN_WINDOW_S",
    "RateWindows",
    "step_rates",
    "NOTABLE_KINDS",
    "MESSAGE_BUDGET",
    "MAX_DRAWN",
    "WORLD_KINDS",
    "WorldStep",
    "world_sizes",
]

#: Most bytes of one per-poll message (samples and events together).
MESSAGE_BUDGET = 4096
#: Most events the chart draws (the newest); the bus keeps more.
MAX_DRAWN = 400
#: Events queued (per queue: nbtools' own, users') until a poll sends them; more are counted, not drawn.
MAX_PENDING = 1000
#: Progress reports queued for the chart's step-rate row (about one per rank a second).
MAX_PROGRESS = 4096
#: Characters of detail text sent per event (hover and list).
TEXT_CHARS = 160

_CATEGORIES = {
    "checkpoint_saved": "save",
    "input_stall": "stall",
    "rank_failed": "failure",
    "failure": "failure",
    "restart": "restart",
    "pool_restarted": "restart",
    "checkpoint_restored": "restore",
    "phase": "phase",
    "launch": "run",
    "finished": "run",
    "hang": "hang",
    "straggler": "straggler",
    "gpu_xid": "failure",
    "gpu_lost": "failure",
    "shrunk": "world",
    "grew": "world",
}
#: The coalesced step reports of the ranks (see :func:`step_rates`).
PROGRESS_KIND = "progress"
#: A rank's CUDA device, by UUID (pairs the rank's row with its GPU's; nothing to draw).
RANK_GPU_KIND = "rank_gpu"
_NOT_DRAWN = (PROGRESS_KIND, "collectives", RANK_GPU_KIND)
_FLAGS = ("hang", "straggler")
#: What each category means, for legends.
CATEGORY_LABELS = {
    "save": "checkpoint save",
    "stall": "input stall",
    "failure": "failure",
    "restart": "restart",
    "restore": "checkpoint restore",
    "phase": "phase",
    "run": "launch / finish",
    "world": "world size changed",
    "hang": "hang (rank flagged)",
    "straggler": "straggler (rank flagged)",
    "mark": "other event",
}
#: Kinds nbtools emits itself: sent before user events when a poll cannot carry all.
NOTABLE_KINDS = frozenset([*_CATEGORIES, "checkpoint_skipped", "cache_full"])


def category(kind: str) -> str:
    """How events of ``kind`` are drawn: save, stall, failure, restart, restore, phase, run,
    world, hang, straggler or mark."""
    return _CATEGORIES.get(kind, "mark")


def _seconds(fields: dict[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return float(value)


def _span_start(event: Event) -> float | None:
    """Start (seconds since the epoch) of the span an event covers, or None for an instant."""
    kind = category(event.kind)
    if kind == "save":
        blocked = _seconds(event.fields, "blocked_s")
        if blocked is None:
            return None
        end = event.time - (_seconds(event.fields, "upload_s") or 0.0)
        return end - blocked
    if kind in ("stall", "restore"):
        took = _seconds(event.fields, "seconds")
        return None if took is None else event.time - took
    if kind in ("hang", "straggler"):
        return _seconds(event.fields, "since")
    return None


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _flag_text(event: Event) -> str | None:
    """A hang as the list says it: which rank, where, for how long, in which collective."""
    fields = event.fields
    stalled = _seconds(fields, "stalled_s")
    if event.kind != "hang" or fields.get("ended") or stalled is None or event.rank is None:
        return None
    node = fields.get("node")
    text = f"rank {event.rank}" + (f" on {node}" if node else "") + f" stalled {stalled:.0f} s"
    collective = fields.get("collective")
    if collective and fields.get("entered") is True:
        return text + f" in {collective}"
    if collective and fields.get("entered") is False:
        return text + f"; the others wait in {collective}, which it never entered"
    if collective:
        return text + f"; the others wait in {collective}"
    since = _seconds(fields, "since")
    return text + (f" since {time.strftime('%H:%M:%S', time.localtime(since))}" if since else "")


def _text(event: Event, local_host: str | None) -> str:
    if category(event.kind) in ("hang", "straggler") and event.message:
        text = _flag_text(event) or event.message  # says which rank, where, since when
        return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "\u2026"
    parts = []
    if local_host is not None and event.host != local_host:
        parts.append(event.host)
    if event.message:
        parts.append(event.message)
    parts += [f"{name}={_value(value)}" for name, value in event.fields.items()]
    text = " · ".join(parts)
    return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "\u2026"


def encode(event: Event, local_host: str | None = None) -> list[Any]:
    """One event as the chart's row: ``[ms, kind, category, rank, step, start ms, text]``.

    A flag (``hang``, ``straggler``) has an eighth column: 1 when it ends the flag.
    """
    start = _span_start(event)
    flag = [1 if event.fields.get("ended") else 0] if category(event.kind) in _FLAGS else []
    return [
        round(event.time * 1000),
        event.kind,
        category(event.kind),
        event.rank,
        event.step,
        None if start is None else round(start * 1000),
        _text(event, local_host),
        *flag,
    ]


def drawn(events: Iterable[Event]) -> list[Event]:
    """The events drawn one by one: all but the ranks' progress reports and their
    answers about collectives (a hang's event already says what they told)."""
    return [e for e in events if e.kind not in _NOT_DRAWN]


#: Shortest span a step rate is measured over: reports come about once a second, and more
#: often around a rank's own events (a save flushes them), where a few milliseconds between
#: two reports would make a burst of steps look like hundreds a second.
MIN_WINDOW_S = 0.9


class RateWindows:
    """One rank's progress reports as step rates, each over a window of ``MIN_WINDOW_S`` or more.

    A window runs from one report to the first report at least ``MIN_WINDOW_S`` later (the
    reports between only move its end); the next window starts where it ended. A report
    from a new process (a restarted rank: another pid, or a count that went back) starts
    afresh: no window spans a restart.
    """

    def __init__(self) -> None:
        self.last: tuple[float, int, int] | None = None  # (time, steps, pid) of the last report
        self._start: tuple[float, int] | None = None
        self._end: tuple[float, int] | None = None

    def add(self, at: float, steps: int, pid: int) -> list[tuple[float, float, float]]:
        """Take one report; returns the windows it closed: ``(start, end, steps per second)``."""
        last, self.last = self.last, (at, steps, pid)
        if last is not None and pid == last[2] and at <= last[0]:
            self.last = last  # out of order: ignored
            return []
        if self._start is None or last is None or pid != last[2] or steps < last[1]:
            closed = self.flush()
            self._start, self._end = (at, steps), None
            return closed
        self._end = (at, steps)
        return self.flush() if at - self._start[0] >= MIN_WINDOW_S else []

    def flush(self) -> list[tuple[float, float, float]]:
        """Close the open window (shorter than ``MIN_WINDOW_S``): the reports end here."""
        if self._start is None or self._end is None:
            return []
        (t0, s0), (t1, s1) = self._start, self._end
        self._start, self._end = self._end, None
        return [(t0, t1, (s1 - s0) / (t1 - t0))]


def _groups(reports: list[Event]) -> dict[int, tuple[float, int]]:
    """Where each process's measure starts: ``index of its first report -> (time, steps)``.

    The ranks of one launch (or one restart) start together, but each reports first when
    its own flusher finds a step: one that waits in a collective for another (which is
    logging, or saving) reports its first steps long after the others. A window that
    began at each rank's own first report would then cover a stall on one rank and only
    the burst after it on another, and lockstep ranks would show different rates. So a
    process's first window starts at its group's first report, at the steps counted there
    (or fewer, the process's own first count). A group is the processes whose first
    reports follow one another until a rank already in it reports from a new process.
    """
    firsts: list[int] = []
    seen: dict[int, tuple[int, int]] = {}  # rank -> (pid, steps) of its latest report
    for index, event in enumerate(reports):
        rank, steps = event.rank, event.fields["steps"]
        before = seen.get(rank)  # type: ignore[arg-type]
        if before is None or before[0] != event.pid or steps < before[1]:
            firsts.append(index)
        seen[rank] = (event.pid, steps)  # type: ignore[index]
    anchors: dict[int, tuple[float, int]] = {}
    group: set[int] = set()
    anchor: tuple[float, int] | None = None
    for index in firsts:
        event = reports[index]
        if anchor is None or event.rank in group:
            group, anchor = set(), (event.time, event.fields["steps"])
        group.add(event.rank)  # type: ignore[arg-type]
        if event.time > anchor[0]:
            anchors[index] = (anchor[0], min(anchor[1], event.fields["steps"]))
    return anchors


def _joined(times: list[float], values: list[float], start: float, end: float, rate: float) -> bool:
    """Fold a window shorter than ``MIN_WINDOW_S`` into the one drawn just before it."""
    if end - start >= MIN_WINDOW_S or len(times) < 2 or times[-1] != start:
        return False
    if math.isnan(values[-1]) or times[-2] == start:
        return False
    before = times[-2]
    steps = values[-1] * (start - before) + rate * (end - start)
    times[-1] = end
    values[-2] = values[-1] = steps / (end - before)
    return True


def step_rates(events: Iterable[Event]) -> dict[int, tuple[list[float], list[float]]]:
    """Each rank's step rate over time from its progress reports: ``rank -> (times, steps/s)``.

    A rate is the steps of a window (:class:`RateWindows`: from one report to the first
    at least ``MIN_WINDOW_S`` later) over its length, drawn over that window: two points,
    at its start and at its end, so a line through them is a step function whose every
    step spans what it measured. Where a rank's windows do not follow on (a restarted
    rank), a point with a NaN rate breaks the line: no rate is drawn over a restart. A
    rank that stops shows a rate of 0 from its last report to the newest of any rank.

    Ranks of one group are measured alike, so that lockstep ranks show one rate and a
    rate that differs says something: a process's first window starts at the group's
    first report (:func:`_groups`), and the short window a process leaves when it ends
    (restarted, finished) joins the window before it rather than showing a burst of a
    few steps, the ones before a save or a kill, as hundreds a second.
    """
    reports = sorted(
        (
            e
            for e in events
            if e.kind == PROGRESS_KIND and e.rank is not None and type(e.fields.get("steps")) is int
        ),
        key=lambda e: e.time,
    )
    anchors = _groups(reports)
    windows: dict[int, RateWindows] = {}
    rates: dict[int, tuple[list[float], list[float]]] = {}
    newest = 0.0

    def draw(rank: int, closed: list[tuple[float, float, float]]) -> None:
        for start, end, rate in closed:
            times, values = rates.setdefault(rank, ([], []))
            if _joined(times, values, start, end, rate):
                continue
            if times and times[-1] != start:  # not the window after the last one
                times.append(start)
                values.append(math.nan)
            times += [start, end]
            values += [rate, rate]

    for index, event in enumerate(reports):
        rank, steps = event.rank, event.fields["steps"]
        assert rank is not None
        newest = max(newest, event.time)
        window = windows.setdefault(rank, RateWindows())
        if index in anchors:  # the process's measure starts with its group's
            at, counted = anchors[index]
            draw(rank, window.add(at, counted, event.pid))
        draw(rank, window.add(event.time, steps, event.pid))
    for rank, window in windows.items():
        draw(rank, window.flush())
    for times, values in rates.values():
        if times and newest - times[-1] > 5.0:  # silent since: no steps
            times += [times[-1], newest]
            values += [0.0, 0.0]
    return rates


#: The events that set the world size (``finished`` ends the line).
WORLD_KINDS = ("launch", "shrunk", "grew", "finished")
_CHANGES = ("shrunk", "grew")


@dataclass(frozen=True)
class WorldStep:
    """One point of the step line: from ``time`` on, the run had ``size`` processes.

    Attributes:
        time: Seconds since the epoch.
        size: Processes from then on; None where the line breaks (a run finished).
        text: What the hover says: the size (of the launch's), why, and from which step.
    """

    time: float
    size: int | None
    text: str


def _count(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _of(size: int, target: int | None) -> str:
    if target is None:
        return f"{size} process{'es' if size != 1 else ''}"
    return f"{size} of {target} process{'es' if target != 1 else ''}"


def _change_text(event: Event, size: int, target: int | None) -> str:
    fields = event.fields
    text = _of(size, target)
    cause = fields.get("cause")
    if isinstance(cause, str) and cause:
        text += f": {cause}"
    step = event.step
    tier = fields.get("tier")
    if type(step) is int:
        text += f", from step {step + 1}"
        if isinstance(tier, str) and tier:
            text += f" ({tier})"
    else:
        text += ", from the function's start"
    return text


def world_sizes(events: Iterable[Event]) -> list[WorldStep]:
    """The run's world size as the points of a step line (``hv``), oldest first.

    Each launch starts the line at its ``world_size``; each ``shrunk`` or ``grew``
    steps it to ``to_world``; ``finished`` ends it (a point, then a break). A change
    whose launch is older than the events given starts the line at its
    ``from_world``. Empty when no ``shrunk`` or ``grew`` is among the events: the
    size never changed, and nothing is drawn.
    """
    ordered = sorted((e for e in events if e.kind in WORLD_KINDS), key=lambda e: e.time)
    if not any(e.kind in _CHANGES for e in ordered):
        return []
    steps: list[WorldStep] = []
    size: int | None = None  # the current size of the run drawn; None between runs
    target: int | None = None  # the launch's size
    for event in ordered:
        fields = event.fields
        if event.kind == "launch":
            launched = _count(fields.get("world_size"))
            if launched is None:
                continue
            size = target = launched
            steps.append(WorldStep(event.time, size, f"{_of(size, None)} at launch"))
        elif event.kind == "finished":
            if size is not None:
                steps.append(WorldStep(event.time, size, f"{_of(size, target)}: finished"))
                steps.append(WorldStep(event.time, None, ""))
            size = None
        else:
            before, after = _count(fields.get("from_world")), _count(fields.get("to_world"))
            if after is None:
                continue
            if size is None and before is not None:  # its launch is older than the events
                target = max(before, after) if target is None else target
                steps.append(WorldStep(event.time, before, f"{_of(before, target)} before"))
            size = after
            if target is None or after > target:
                target = after
            steps.append(WorldStep(event.time, after, _change_text(event, after, target)))
    return steps


def _size(value: Any) -> int:
    # Jupyter serialises messages with json.dumps' default separators and no ASCII escaping.
    return len(json.dumps(value, ensure_ascii=False).encode())


#: The columns every event has, in order; its fields follow.
EVENT_COLUMNS = ("time", "host", "rank", "kind", "message", "step", "pid")


def event_rows(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Events as flat rows: time, host, rank, kind, message, step, pid, then every field."""
    rows = []
    for event in events:
        row = {
            "time": event.time,
            "host": event.host,
            "rank": event.rank,
            "kind": event.kind,
            "message": event.message,
            "step": event.step,
            "pid": event.pid,
        }
        row.update(event.fields)  # field names never repeat these (emit refuses them)
        rows.append(row)
    return rows


def announce_rank_gpu() -> None:
    """In a rank at its start: say which CUDA device it uses, by UUID (nothing on a rank
    that has not started CUDA, such as a CPU rank), so the pane pairs its rows.

    NVML numbers GPUs in PCI order and sees every GPU of the host; CUDA numbers
    them fastest first and only those ``CUDA_VISIBLE_DEVICES`` shows. The UUID is
    the same in both.
    """
    import torch

    if not torch.cuda.is_initialized():  # a CPU rank asks the driver nothing
        return
    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    _events.emit(RANK_GPU_KIND, f"uses CUDA device {index} ({uuid})", uuid=uuid, cuda=index)


def same_device(nvml_uuid: str, cuda_uuid: str) -> bool:
    """Whether NVML's UUID of a GPU or MIG device (``GPU-…``, ``MIG-…``) and the one CUDA
    gives a rank's device (torch prints it with or without that prefix) are one device."""

    def body(text: str) -> str:
        text = text.strip().lower()
        for prefix in ("gpu-", "mig-"):
            if text.startswith(prefix):
                return text[len(prefix) :]
        return text

    return bool(nvml_uuid and cuda_uuid) and body(nvml_uuid) == body(cuda_uuid)


def gpu_ranks(
    latest: dict[Any, Any], rank_gpus: dict[int, tuple[str, str]]
) -> dict[Any, list[int]]:
    """Which ranks use each GPU row: ``(host, index) -> ranks``, matched by UUID.

    Args:
        latest: ``(host, index) -> GPUReading`` (its ``uuid`` is NVML's).
        rank_gpus: ``rank -> (host, CUDA UUID)`` from the ranks' ``rank_gpu`` events.
    """
    out: dict[Any, list[int]] = {}
    for rank, (host, uuid) in sorted(rank_gpus.items()):
        for (where, index), reading in latest.items():
            if where == host and same_device(getattr(reading, "uuid", ""), uuid):
                out.setdefault((where, index), []).append(rank)
    return out


class EventFeed:
    """New events of a bus, queued for the chart; the bus itself keeps the record.

    Args:
        bus: Where events arrive (``nbtools.events.bus()`` in the kernel).
        horizon_s: Seconds of events kept for drawing (the pane's history).
        local_host: Host whose events are shown without a host name.
        clock: Current time in seconds since the epoch.
    """

    def __init__(
        self,
        bus: Bus,
        horizon_s: float,
        local_host: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.horizon_s = float(horizon_s)
        self.local_host = local_host
        self._clock = clock
        self._notable: deque[Event] = deque(maxlen=MAX_PENDING)
        self._other: deque[Event] = deque(maxlen=MAX_PENDING)
        self._progress: deque[Event] = deque(maxlen=MAX_PROGRESS)
        self._lock = threading.Lock()
        self._overflow = 0  # queued events pushed out before a poll took them
        #: Events that arrived and may move the world size's line (:func:`world_sizes`).
        self.world_events = 0
        self._closed = False
        #: ``rank -> (host, CUDA UUID)`` of the ranks that said which GPU they use.
        self.rank_gpus: dict[int, tuple[str, str]] = {}
        self._devices(bus.log(kinds=[RANK_GPU_KIND]))
        bus.subscribe(self._arrived)

    def _devices(self, events: list[Event]) -> None:
        for event in events:
            uuid = event.fields.get("uuid")
            if event.kind == RANK_GPU_KIND and event.rank is not None and isinstance(uuid, str):
                self.rank_gpus[event.rank] = (event.host, uuid)

    def _arrived(self, events: list[Event]) -> None:
        # Runs on the delivering thread (the collector's reader): queue and count only.
        with self._lock:
            for event in events:
                if event.kind == PROGRESS_KIND:
                    self._progress.append(event)  # drawn as step rates, not one by one
                    continue
                if event.kind in _NOT_DRAWN:
                    self._devices([event])
                    continue
                if event.kind in WORLD_KINDS:  # may move the world size's line
                    self.world_events += 1
                queue = self._notable if event.kind in NOTABLE_KINDS else self._other
                if len(queue) == MAX_PENDING:
                    self._overflow += 1  # the oldest queued event falls out
                queue.append(event)

    @property
    def pending(self) -> int:
        """Events queued for the next poll."""
        return len(self._notable) + len(self._other)

    @property
    def not_drawn(self) -> int:
        """Events that reached the bus but were never drawn (too many at once)."""
        with self._lock:
            return self._overflow

    def dropped(self) -> int:
        """Events the ranks dropped before they reached the kernel."""
        return self.bus.dropped()

    def take(self, budget: int) -> list[list[Any]]:
        """Rows of the oldest queued events that fit in ``budget`` bytes of JSON.

        The events nbtools emits go first, then user events; what does not fit
        waits for the next poll. A queue that overflows between polls loses its
        oldest events from the drawing (counted in :attr:`not_drawn`; the bus
        and ``pane.events()`` still have them).
        """
        rows: list[list[Any]] = []
        used = 2
        with self._lock:
            for queue in (self._notable, self._other):
                while queue:
                    row = encode(queue[0], self.local_host)
                    size = _size(row) + 2
                    if used + size > budget:
                        return rows
                    queue.popleft()
                    rows.append(row)
                    used += size
        return rows

    def take_progress(self) -> list[Event]:
        """The ranks' progress reports that arrived since the last call, oldest first."""
        with self._lock:
            reports = list(self._progress)
            self._progress.clear()
        return reports

    def snapshot(self) -> list[list[Any]]:
        """Rows of the newest events kept for drawing (at most ``MAX_DRAWN``), oldest first.

        Empties the queue: whatever it held is in the snapshot (a row sent twice
        is drawn once).
        """
        with self._lock:
            self._notable.clear()
            self._other.clear()
        kept = drawn(self.bus.log(since=self._clock() - self.horizon_s))
        return [encode(e, self.local_host) for e in kept[-MAX_DRAWN:]]

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        if not self._closed:
            self._closed = True
            self.bus.unsubscribe(self._arrived)
            with self._lock:
                self._notable.clear()
                self._other.clear()
                self._progress.clear()
