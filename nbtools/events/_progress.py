"""``step``: a rank's step boundaries, coalesced into one report a second.

The training thread pays for a few stores into a list and one clock read:
no lock, no allocation, no event per step. The events flusher thread
(:mod:`nbtools.events._emitter`) looks at that list about once a second and,
when the count moved, queues one ``progress`` event carrying the latest step,
the number of steps so far and the time of the last one. So a loop of any
speed costs the channel at most one event a second per rank, and a full
channel drops (and counts) progress like any other event, never blocking.

The kernel turns these reports into step rates, hang and straggler flags
(``nbtools._hangs``). A GPU rank's report also carries its share of recent
time outside NCCL's collectives, from NCCL's Flight Recorder
(:func:`nbtools.events._recorder.device_outside`, measured every few seconds
on the flusher thread): the straggler score of a rank whose wait in a
collective is a spin that the kernel's look at its process reads as work.

Explicit step numbers win. A loop that uses nbtools' ``DataLoader`` (a
mark per batch, ``step(None)``) and ``CheckpointManager.maybe_save`` (a
numbered ``step(n)`` per training step) would otherwise count two steps per
training step and halve the step time the kernel judges by. So once a process
has reported a numbered step, its unnumbered marks no longer count as steps:
they only say that the rank is alive (an evaluation loop over a loader), and
the report carries the time of the latest one as ``alive``.

A long phase that is not a hang (an evaluation, a save) can be named with
:class:`phase`: the reports carry the innermost open phase's name, sent as
soon as it opens or closes, and the kernel gives a rank in a named phase a
much longer bound (see ``nbtools._hangs``). A rank also reports once as it
starts (:func:`started`, run by the launcher's rank set-up), so the kernel
knows its process before its first step.

A rank also samples its own training thread (:mod:`._probe`): the reports
carry how much of the time it waited in a collective, what it does now, and
its process tree's CPU and I/O, and while it makes no progress one such
report still leaves every second. A kernel on another machine (Ray) judges
the rank by these, as it judges a rank on its own machine by looking at it.

A process without a channel (the kernel, a plain script) keeps the count
only; nothing is sent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from nbtools._internal import hooks, settings
from nbtools.events import _emit, _probe, _recorder
from nbtools.events._wire import Record

__all__ = ["step", "phase", "started", "PROGRESS_KIND", "progress_so_far", "new_call"]

#: The kind of the coalesced reports.
PROGRESS_KIND = "progress"

# [last step (int or None), steps so far, epoch time of the last step, epoch time of
# the last mark of any kind, whether a numbered step was reported]. Written only by
# the training thread; the flusher reads it. A torn read (count from one call, time
# from the next) is harmless: the next report carries both.
_latest: list[Any] = [None, 0, 0.0, 0.0, False]
_shipped: list[Any] = [0, 0.0, None]  # the count, the last mark and the phase last sent
_phases: list[str] = []  # the open phases of this process, innermost last
_tid = [0]  # the native id of the thread that reports (the training thread)
_probes: list[_probe.Probe] = []  # this rank's look at its training thread (one, once hooked)
_sent_at = [0.0]  # monotonic time of the last report sent
#: While a rank makes no progress, its probe's findings still leave this often.
PROBE_REPORT_S = 1.0
_hooked = [False]  # reset in a forked child, which hooks its own flusher
_hook_lock = threading.Lock()
_time = time.time


def step(step: int | None = None) -> None:
    """Report that this rank finished a training step; costs about a microsecond.

    Call it once per step of a loop that nbtools does not see otherwise
    (``CheckpointManager.maybe_save`` and nbtools' ``DataLoader`` report by
    themselves). The kernel learns each rank's pace from these reports and
    flags hangs and stragglers. Never blocks, never raises for a full channel.

    Numbered steps win: once this process reported a step number, calls
    without one (the loader's batches) only mark the rank as alive and are
    not counted as steps, so a loop that reports both counts each training
    step once.

    Args:
        step: The step just finished (an int), or None to count steps only.

    Raises:
        TypeError: ``step`` is neither an int nor None.

    Example:
        >>> from nbtools import events
        >>> for i in range(3):
        ...     events.step(i)
    """
    latest = _latest
    if step is None:
        if latest[4]:  # numbered steps count; this mark only says "alive"
            latest[3] = _time()
            return
    else:
        if step.__class__ is not int:
            step = _checked(step)
        latest[4] = True
    latest[0] = step
    latest[1] += 1
    latest[2] = latest[3] = _time()
    if not _hooked[0]:
        _hook()


class phase(contextlib.ContextDecorator):
    """Name a long phase of this rank that is not a hang: ``with events.phase("evaluate"):``.

    Also a decorator (``@events.phase("evaluate")``). While the phase is open, the
    kernel gives this rank a much longer bound before it calls it hung (a
    quarter of an hour or more, see ``nbtools._hangs``), and the ranks that wait
    for it are never named. Phases nest; the innermost one is reported. Opening
    and closing cost about a microsecond each and never block.

    Args:
        name: What the rank does, e.g. ``"evaluate"``; at most 100 characters.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty or longer than 100 characters.

    Example:
        >>> from nbtools import events
        >>> with events.phase("evaluate"):
        ...     pass  # rank 0 evaluates while the others wait in a barrier
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"events.phase takes a name (str), got {type(name).__name__}")
        if not name.strip() or len(name) > 100:
            raise ValueError(f"a phase's name has 1 to 100 characters, got {name!r:.120}")
        self.name = name

    def __enter__(self) -> phase:
        _phases.append(self.name)
        if not _hooked[0]:
            _hook()
        return self

    def __exit__(self, *exc: object) -> None:
        if _phases and _phases[-1] == self.name:
            _phases.pop()
        elif self.name in _phases:
            _phases.remove(self.name)


def started() -> None:
    """In a rank, at its start: send one report with no steps, so the kernel knows it."""
    if not _hooked[0]:
        _hook()
    _shipped[0] = -1  # differs from any count: the flusher sends the next report now


def new_call() -> None:
    """A kept rank (a pool's) starts another call: until it reports a numbered step
    again, its batch marks count as steps (a call that only loops over a loader)."""
    _latest[4] = False


def progress_so_far() -> tuple[int | None, int, float]:
    """``(last step, steps counted, epoch time of the last)`` of this process."""
    step_, count, at = _latest[:3]
    return step_, count, at


def _checked(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"events.step takes the step number as an int (or None), got "
            f"{type(value).__name__} {value!r:.40}"
        )
    return int(value.__index__())


def _hook() -> None:
    """Once per process: have the flusher thread ship the latest count."""
    with _hook_lock:
        if _hooked[0]:
            return
        _tid[0] = threading.get_native_id()  # the kernel samples this thread of the rank
        _emit._setup()  # choose this process's route now
        emitter = _emit._emitter
        if emitter is not None:
            _probes[:] = [_probe.Probe(_tid[0]).start()]  # a rank: it samples itself
            emitter.add_source(_collect)
        _hooked[0] = True


def _collect() -> list[Record]:
    """On the flusher thread: the report to send, if any step or mark happened since the last,
    or if the last report left :data:`PROBE_REPORT_S` ago (with the probe's findings only).

    The report is stamped with the time of the last step (before the first, with
    its own); a later mark that counts no step (see the module docstring) travels
    as ``alive``, and the open phase, if any, as ``phase``. What the rank's probe
    saw since the last report rides along (:meth:`nbtools.events._probe.Probe.take`),
    for a kernel on another machine, which cannot look at this process itself.
    """
    step_, count, at, marked, _ = _latest
    current = _phases[-1] if _phases else None
    moved = count != _shipped[0] or marked > _shipped[1] or current != _shipped[2]
    now = time.monotonic()
    if not moved and not (_probes and now - _sent_at[0] >= PROBE_REPORT_S):
        return []
    _shipped[0], _shipped[1], _shipped[2] = count, marked, current
    _sent_at[0] = now
    fields: dict[str, Any] = {"steps": count, "cpu": round(time.process_time(), 3)}
    if marked > at:
        fields["alive"] = round(marked, 3)
    if current is not None:
        fields["phase"] = current
    if _tid[0] and _tid[0] != os.getpid():  # a rank that trains on another thread (Ray's)
        fields["tid"] = _tid[0]
    if count:
        outside = _recorder.device_outside(_window_s())
        if outside is not None:  # a GPU rank: its share outside NCCL's collectives
            fields["outside"] = round(outside, 4)
    if not moved:
        fields["still"] = True  # the probe's findings only: nothing moved since the last
    for probe in _probes:
        fields.update(probe.take())
    stamp = at if count else _time()  # a report before the first step: its own time
    return [(stamp, _emit._rank, PROGRESS_KIND, None, step_, fields)]


def _window_s() -> float:
    """The window of the kernel's straggler scores (its setting reaches the ranks too)."""
    value = settings.read("NBTOOLS_STRAGGLER_WINDOW_S")
    return 30.0 if value is None else float(value)


def _after_fork_in_child() -> None:
    # A child (a loader worker) counts its own steps, if any, from zero.
    global _hook_lock
    _hook_lock = threading.Lock()
    _latest[:] = [None, 0, 0.0, 0.0, False]
    _shipped[:] = [0, 0.0, None]
    _phases.clear()
    _tid[0] = 0
    _probes.clear()  # the parent's probe thread is not in the child
    _sent_at[0] = 0.0
    _hooked[0] = False


# A rank reports as it starts: the launcher's rank set-up runs the in-rank hooks.
hooks.register("nbtools.events", in_rank="nbtools.events._progress:started")

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
