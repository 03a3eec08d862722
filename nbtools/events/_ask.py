"""The kernel's question to the ranks, and their answer, over the events channel.

One question travels this way: "which collective are you in?". The kernel
touches an *ask* file beside each channel it collects (:func:`ask`). Each
rank's events flusher thread, which runs beside the training thread and is
free while that thread waits in a collective, notices the new time within a
fraction of a second (one ``stat`` every :data:`_CHECK_S`), reads torch's
Flight Recorder (:func:`read_positions`) and sends one ``collectives`` event
per process group: the last collective the rank enqueued, the last one that
completed, and the name of the last one. A stopped rank cannot answer.

The answers are the reply to the ask that caused them: the kernel's bus hands
each ``collectives`` event to the :class:`Ask` waiting for it
(:func:`divert`), and nothing else sees it. Nothing is read while steps flow:
the only steady cost is the ``stat`` on the flusher thread.

Ranks that no ask file of the kernel reaches (Ray ranks, whose channel ends
in a collector inside their own actor) are asked by a callable that a
launcher adds (:func:`add_asker`): the Ray launcher's calls the actors, and
each actor touches its own collector's ask file (``Collector.ask``); the
answers come back with the rank's other events and reach the same :class:`Ask`.

The recorders are read by :mod:`nbtools.events._recorder`: gloo's and, on a
CUDA build, NCCL's. The recorder must be on before the process group is created: the collector
puts ``TORCH_FR_BUFFER_SIZE`` (:data:`BUFFER_ENV`) in the ranks' environment
unless the kernel's environment sets it. This module imports no torch: it
reads the recorder only in a process that already loaded torch.distributed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from nbtools._internal.log import get_logger
from nbtools.events._record import Event
from nbtools.events._recorder import read_positions
from nbtools.events._wire import Record

__all__ = [
    "KIND",
    "BUFFER_ENV",
    "BUFFER_SIZE",
    "ANSWER_S",
    "Ask",
    "ask",
    "divert",
    "ask_path",
    "register",
    "unregister",
    "add_asker",
    "remove_asker",
    "touch",
    "Answerer",
    "read_positions",
]

_log = get_logger("events")

#: The kind of a rank's answer.
KIND = "collectives"
#: torch's switch for the Flight Recorder (entries kept per process).
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
#: What the collector asks for when the kernel's environment says nothing.
BUFFER_SIZE = "2000"
#: How long the asker waits for the ranks' answers.
ANSWER_S = 3.0
_ASK_SUFFIX = ".ask"
_CHECK_S = 0.25  # the flusher looks at the ask file at most this often
_SETTLE_S = 0.1  # the rest of an answer's groups, sent in the same batch

_asks: set[str] = set()  # ask files of the collectors of this process (the kernel)
_askers: list[Callable[[], int]] = []  # launchers' ways to ask ranks no ask file reaches
_pending: list[Ask] = []  # the asks waiting for answers
_lock = threading.Lock()


def ask_path(channel: str) -> str | None:
    """The ask file of a ``fifo:<path>`` channel; None for any other transport."""
    if not channel.startswith("fifo:"):
        return None
    return channel[len("fifo:") :] + _ASK_SUFFIX


# --- kernel side -----------------------------------------------------------------------


class Ask:
    """One question to every rank; the answers that arrive while it is open gather here.

    Made by :func:`ask`; close it (or use it as a context manager) once answered.
    """

    def __init__(self) -> None:
        self.asked = 0  # channels and ranks asked
        self._answers: dict[int, list[Event]] = {}
        self._changed = threading.Condition()

    def _add(self, event: Event) -> None:
        with self._changed:
            self._answers.setdefault(event.rank, []).append(event)  # type: ignore[arg-type]
            self._changed.notify_all()

    def wait(
        self,
        expected: set[int],
        timeout: float = ANSWER_S,
        stop: threading.Event | None = None,
    ) -> dict[int, list[Event]]:
        """The answers, once every rank in ``expected`` answered or ``timeout`` passed.

        Returns:
            ``rank -> events`` (one event per process group) of the ranks that answered.
        """
        deadline = time.monotonic() + timeout
        if self.asked:
            with self._changed:
                while not expected <= self._answers.keys():
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop.is_set()):
                        break
                    self._changed.wait(min(left, 0.1))
            if expected and expected <= self._answers.keys():
                time.sleep(_SETTLE_S)
        with self._changed:
            return {rank: list(events) for rank, events in self._answers.items()}

    def close(self) -> None:
        """Stop gathering answers."""
        with _lock:
            if self in _pending:
                _pending.remove(self)

    def __enter__(self) -> Ask:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ask() -> Ask:
    """Ask every rank which collective it is in; wait on the returned :class:`Ask`."""
    request = Ask()
    with _lock:
        _pending.append(request)  # before asking: an answer may come back at once
        paths = list(_asks)
        askers = list(_askers)
    request.asked = sum(1 for path in paths if touch(path))
    for asker in askers:
        try:
            request.asked += asker()
        except Exception:  # noqa: BLE001 - one launcher's failure must not silence the rest
            _log.debug("asking ranks for their collectives failed", exc_info=True)
    return request


def divert(events: list[Event]) -> list[Event]:
    """Hand the answers among ``events`` to the open asks; returns the other events."""
    if not any(e.kind == KIND for e in events):
        return events
    with _lock:
        pending = list(_pending)
    rest = []
    for event in events:
        if event.kind != KIND:
            rest.append(event)
        elif event.rank is not None:
            for request in pending:
                request._add(event)  # this module's own class
    return rest


def register(path: str) -> None:
    """A collector of this process accepts requests at ``path`` (its channel's ask file)."""
    with _lock:
        _asks.add(path)


def unregister(path: str) -> None:
    """The collector stopped: forget ``path`` and remove the file."""
    with _lock:
        _asks.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def add_asker(asker: Callable[[], int]) -> None:
    """Also call ``asker()`` on each request; it asks ranks elsewhere and returns how many."""
    with _lock:
        _askers.append(asker)


def remove_asker(asker: Callable[[], int]) -> None:
    """Stop calling ``asker``; removing one that was never added is harmless."""
    with _lock:
        if asker in _askers:
            _askers.remove(asker)


def touch(path: str) -> bool:
    """Write a new request into the ask file ``path``; False when it cannot be written."""
    try:
        with open(path, "w") as f:
            f.write(f"{time.time():.6f}\n")
        return True
    except OSError as exc:
        _log.debug("could not ask the ranks at %s for their collectives: %s", path, exc)
        return False


# --- rank side ---------------------------------------------------------------------------


class Answerer:
    """A source for the flusher thread: answers each new request with the rank's position.

    Args:
        path: The ask file to watch.
        rank: This process's rank, stamped on the answers.
    """

    def __init__(self, path: str, rank: int | None) -> None:
        self._path = path
        self._rank = rank
        self._checked = 0.0
        self._answered = self._stamp()  # a request older than this process is not for it

    def _stamp(self) -> int:
        try:
            return os.stat(self._path).st_mtime_ns
        except OSError:
            return 0

    def __call__(self) -> list[Record]:
        now = time.monotonic()
        if now - self._checked < _CHECK_S:
            return []
        self._checked = now
        stamp = self._stamp()
        if not stamp or stamp == self._answered:
            return []
        self._answered = stamp
        positions = read_positions()
        if positions is None:
            return []
        at = time.time()
        return [(at, self._rank, KIND, None, None, fields) for fields in positions]
