"""Which collective each rank is in: torch's Flight Recorder, read on request.

torch records every collective a process group issues (the Flight Recorder;
gloo records too): its sequence number, its name, and whether it completed.
When the kernel's watchdog finds a hang it asks the ranks for their position:
it touches an *ask* file beside the events channel (:func:`ask_all`). Each
rank's events flusher thread, which runs beside the training thread and is
free while that thread waits in a collective, notices the new time within a
fraction of a second (one ``stat`` every :data:`_CHECK_S`), reads the
recorder's state (:func:`read_positions`) and sends one ``collectives`` event
per process group: the last collective the rank enqueued, the last one that
completed, and the name of the last one. A stopped rank cannot answer; its
silence is reported as such.

The kernel turns the answers into words (:func:`describe`): "ranks 0, 2, 3
wait in all_reduce #1812, which rank 1 never entered (its last: all_reduce
#1811)". Nothing is read while steps flow: the only steady cost is the
``stat`` on the flusher thread.

Ranks that no ask file of the kernel reaches (Ray ranks, whose channel
ends in a collector inside their own actor) are asked by a callable that a
launcher adds (:func:`add_asker`): the Ray launcher's calls the actors, and
each actor touches its own collector's ask file (:meth:`Collector.ask`); the
answers come back with the rank's other events.

The recorder must be on before the process group is created: the collector
puts ``TORCH_FR_BUFFER_SIZE`` (:data:`BUFFER_ENV`) in the ranks' environment
unless the kernel's environment sets it. This module imports no torch: it
reads the recorder only in a process that already loaded torch.distributed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.events._wire import Record

__all__ = [
    "KIND",
    "BUFFER_ENV",
    "BUFFER_SIZE",
    "ask_path",
    "register",
    "unregister",
    "add_asker",
    "remove_asker",
    "touch",
    "ask_all",
    "Answers",
    "ANSWER_S",
    "Answerer",
    "read_positions",
    "describe",
    "in_flight",
]

_log = get_logger("events")

#: The kind of a rank's answer.
KIND = "collectives"
#: torch's switch for the Flight Recorder (entries kept per process).
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
#: What the collector asks for when the kernel's environment says nothing.
BUFFER_SIZE = "2000"
_ASK_SUFFIX = ".ask"
_CHECK_S = 0.25  # the flusher looks at the ask file at most this often
_MAX_GROUPS = 8  # process groups answered per request
#: How long a hang report waits for the ranks' answers.
ANSWER_S = 3.0

_asks: set[str] = set()  # ask files of the collectors of this process (the kernel)
_askers: list[Callable[[], int]] = []  # launchers' ways to ask ranks no ask file reaches
_asks_lock = threading.Lock()


def ask_path(channel: str) -> str | None:
    """The ask file of a ``fifo:<path>`` channel; None for any other transport."""
    if not channel.startswith("fifo:"):
        return None
    return channel[len("fifo:") :] + _ASK_SUFFIX


# --- kernel side -----------------------------------------------------------------------


def register(path: str) -> None:
    """A collector of this process accepts requests at ``path`` (its channel's ask file)."""
    with _asks_lock:
        _asks.add(path)


def unregister(path: str) -> None:
    """The collector stopped: forget ``path`` and remove the file."""
    with _asks_lock:
        _asks.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def add_asker(ask: Callable[[], int]) -> None:
    """Also call ``ask()`` on each request; it asks ranks elsewhere and returns how many."""
    with _asks_lock:
        _askers.append(ask)


def remove_asker(ask: Callable[[], int]) -> None:
    """Stop calling ``ask``; removing one that was never added is harmless."""
    with _asks_lock:
        if ask in _askers:
            _askers.remove(ask)


def touch(path: str) -> bool:
    """Write a new request into the ask file ``path``; False when it cannot be written."""
    try:
        with open(path, "w") as f:
            f.write(f"{time.time():.6f}\n")
        return True
    except OSError as exc:
        _log.debug("could not ask the ranks at %s for their collectives: %s", path, exc)
        return False


def ask_all() -> int:
    """Ask every rank for its collectives; returns how many channels or ranks were asked."""
    with _asks_lock:
        paths = list(_asks)
        askers = list(_askers)
    asked = sum(1 for path in paths if touch(path))
    for ask in askers:
        try:
            asked += ask()
        except Exception:  # noqa: BLE001 - one launcher's failure must not silence the rest
            _log.debug("asking ranks for their collectives failed", exc_info=True)
    return asked


class Answers:
    """The kernel's record of the ranks' answers, and the wait for them after asking."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # rank -> (arrival time, positions) of its latest answer
        self._latest: dict[int, tuple[float, list[dict[str, Any]]]] = {}

    def add(self, event: Any) -> None:
        """Keep one ``collectives`` event (one process group of a rank's answer)."""
        arrived = time.time()
        with self._lock:
            at, positions = self._latest.get(event.rank, (0.0, []))
            if arrived - at > ANSWER_S:  # a new answer, not another group of the same one
                positions = []
            self._latest[event.rank] = (arrived, [*positions, dict(event.fields)])

    def ask(self, expected: set[int], stop: threading.Event) -> dict[int, list[dict[str, Any]]]:
        """Ask every local rank; wait up to :data:`ANSWER_S` for the ``expected`` ranks.

        Returns:
            ``rank -> positions`` of the ranks that answered this request.
        """
        asked = time.time()
        if not ask_all():
            return {}
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline and not stop.is_set():
            with self._lock:
                answered = {r for r, (at, _) in self._latest.items() if at >= asked}
            if expected <= answered:
                time.sleep(0.1)  # the rest of an answer's groups, sent in the same batch
                break
            time.sleep(0.05)
        with self._lock:
            return {r: p for r, (at, p) in self._latest.items() if at >= asked}


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


def read_positions() -> list[dict[str, Any]] | None:
    """This process's Flight Recorder state, one dict of scalars per process group.

    Keys: ``pg`` (the group's id), ``enqueued`` and ``completed`` (sequence
    numbers of the last collective issued and the last finished), ``op`` and
    ``op_seq`` (name and number of the last recorded collective), ``size`` (the
    group's ranks). None when torch.distributed is not loaded or records
    nothing.
    """
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        trace = json.loads(dump(includeCollectives=True, onlyActive=False))
    except Exception as exc:  # noqa: BLE001 - a torch without a recorder: nothing to say
        _log.debug("reading the Flight Recorder failed: %s", exc)
        return None
    status = trace.get("pg_status") or {}
    last: dict[str, tuple[int, str]] = {}
    for entry in trace.get("entries") or []:
        if entry.get("is_p2p"):
            continue
        pg = str(entry.get("pg_id", ""))
        seq = _int(entry.get("collective_seq_id"))
        if seq is not None and (pg not in last or seq >= last[pg][0]):
            last[pg] = (seq, str(entry.get("profiling_name") or "?"))
    positions = []
    for pg, values in list(status.items())[:_MAX_GROUPS]:
        enqueued = _int(values.get("last_enqueued_collective"))
        completed = _int(values.get("last_completed_collective"))
        if enqueued is None or enqueued < 0:
            continue
        seq, name = last.get(str(pg), (None, None))
        positions.append(
            {
                "pg": str(pg),
                "enqueued": enqueued,
                "completed": completed if completed is not None else -1,
                "op": _op_name(name) if name else None,
                "op_seq": seq,
            }
        )
    return positions or None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _op_name(profiling_name: str) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``."""
    return profiling_name.rsplit(":", 1)[-1]


# --- the kernel's words ---------------------------------------------------------------------


def in_flight(
    answers: dict[int, list[dict[str, Any]]],
) -> list[tuple[str, int, list[int], dict[int, int]]]:
    """The collective in flight in each process group, from the ranks' answers.

    Returns:
        ``(op, seq, ranks in it, {rank behind: the last it entered})`` per process
        group where some rank is inside a collective.
    """
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, positions in answers.items():
        for pos in positions:
            groups.setdefault(str(pos.get("pg")), {})[rank] = pos
    found = []
    for _, by_rank in sorted(groups.items()):
        inside = {r: p for r, p in by_rank.items() if p["enqueued"] > p["completed"]}
        if not inside:
            continue
        seq = max(p["enqueued"] for p in inside.values())
        waiting = sorted(r for r, p in inside.items() if p["enqueued"] == seq)
        named = [p for p in inside.values() if p["enqueued"] == seq and p.get("op_seq") == seq]
        op = named[0]["op"] if named and named[0].get("op") else "a collective"
        behind = {r: p["enqueued"] for r, p in sorted(by_rank.items()) if p["enqueued"] < seq}
        found.append((op, seq, waiting, behind))
    return found


def describe(
    answers: dict[int, list[dict[str, Any]]], culprits: list[int], world_size: int
) -> list[str]:
    """Lines naming the collective the waiting ranks are in and who never entered it.

    Args:
        answers: ``rank -> positions`` (:func:`read_positions`' dicts) of the ranks
            that answered.
        culprits: The flagged ranks.
        world_size: Ranks in the group.

    Returns:
        One line per process group with a collective in flight, e.g.
        ``ranks 0, 2, 3 wait in all_reduce #1812, which rank 1 never entered
        (last entered: rank 1: #1811)``; empty when no rank answered or none is
        in one.
    """
    lines = []
    silent = sorted(r for r in range(world_size) if r not in answers and r in culprits)
    for op, seq, waiting, behind in in_flight(answers):
        line = (
            f"{_ranks('rank', waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {op} #{seq}"
        )
        parts = []
        if behind:
            lasts = ", ".join(f"rank {r}: #{last}" for r, last in behind.items())
            parts.append(
                f"which {_ranks('rank', list(behind))} never entered (last entered: {lasts})"
            )
        if silent:
            parts.append(
                f"{_ranks('rank', silent)} could not answer (stopped?), so "
                f"{'it is' if len(silent) == 1 else 'they are'} not known to be in it"
            )
        lines.append(line + (", " + "; ".join(parts) if parts else ""))
    return lines


def _ranks(word: str, ranks: list[int]) -> str:
    listed = ", ".join(str(r) for r in ranks)
    return f"{word} {listed}" if len(ranks) == 1 else f"{word}s {listed}"
