"""Events of a training run, from every rank to the kernel, for the timeline.

``emit`` works in any process: a rank, a loader worker, the kernel. Ranks and
their children send through a channel the launcher owns (a named pipe; no TCP
listener) and never block; the kernel keeps the events, bounded, for 2 hours.

Example:
    >>> from nbtools import events
    >>> events.emit("eval", message="val loss 1.93", step=1200, value=1.93)
    >>> [e.kind for e in events.log(kinds=["eval"])][-1:]
    ['eval']
    >>> events.step(1200)   # a step boundary: about a microsecond, never blocks
    >>> with events.phase("evaluate"):   # a long phase that is not a hang
    ...     pass

Kernel side, for a launcher::

    collector = events.Collector(run_dir).start()   # before the ranks start
    rank_env.update(collector.environment())        # each rank's environment
    ...                                             # ranks call events.flush() at their end
    collector.stop()                                # after they exit: all delivered

The kernel can ask the ranks which collective they are in
(``events.ask_collectives()``; the hang reports do): their answers come back
as the reply to that ask. A launcher whose ranks live where no ask file of
the kernel reaches (Ray actors) adds a way to ask them
(``events.add_collectives_asker(ask)``), and names each rank's node through
``NODE_ENV`` in its environment.

The kernel's watch over these reports (hangs, stragglers) is a room of its
own above this one (``nbtools._hangs``). This package is stdlib-only and
imports no other nbtools package but the base.
"""

from __future__ import annotations

from collections.abc import Iterable

from nbtools.events._ask import add_asker as add_collectives_asker
from nbtools.events._ask import ask as ask_collectives
from nbtools.events._ask import remove_asker as remove_collectives_asker
from nbtools.events._bus import Bus, Subscriber
from nbtools.events._collector import Collector
from nbtools.events._emit import BUS as _BUS
from nbtools.events._emit import NODE_ENV, NODE_SEPARATOR, emit, flush
from nbtools.events._progress import PROGRESS_KIND, phase, step
from nbtools.events._record import Event
from nbtools.events._sinks import CHANNEL_ENV

__all__ = [
    "CHANNEL_ENV",
    "NODE_ENV",
    "NODE_SEPARATOR",
    "Bus",
    "Collector",
    "Event",
    "PROGRESS_KIND",
    "add_collectives_asker",
    "ask_collectives",
    "bus",
    "dropped",
    "emit",
    "flush",
    "log",
    "phase",
    "remove_collectives_asker",
    "step",
    "subscribe",
    "unsubscribe",
]


def bus() -> Bus:
    """The bus of this process: every event that reached it (the kernel's view)."""
    return _BUS


def log(since: float | None = None, kinds: Iterable[str] | None = None) -> list[Event]:
    """Events kept by this process's bus, oldest first (see :meth:`Bus.log`)."""
    return _BUS.log(since=since, kinds=kinds)


def dropped() -> int:
    """Events that ranks reported as dropped because the kernel did not keep up."""
    return _BUS.dropped()


def subscribe(callback: Subscriber) -> Subscriber:
    """Call ``callback(events)`` with each group of events that arrives; returns it.

    The callback runs on the thread that delivered the events (the collector's
    reader, or the caller of ``emit`` in the kernel): keep it quick.
    """
    return _BUS.subscribe(callback)


def unsubscribe(callback: Subscriber) -> None:
    """Stop calling ``callback``."""
    _BUS.unsubscribe(callback)
