"""Bringing every Ray rank's output and events to this machine, live.

One thread keeps one :meth:`RankActor.output` call in flight per rank and
appends what comes back to that rank's files in the attempt directory, where
the launcher's :class:`~nbtools.launch._output.OutputForwarder` tails them as
it tails local ranks' files. Events go onto this process's events bus.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from nbtools._internal.log import get_logger

__all__ = ["OutputPump", "THREAD_NAME"]

_log = get_logger("launch")
THREAD_NAME = "nbtools-ray-output"
# How long one output call may wait in the actor for something new.
_LONG_POLL_S = 0.2


class OutputPump:
    """Fetches each rank's output into ``stdouts[rank]``/``stderrs[rank]`` until stopped.

    Args:
        ray: the ``ray`` module.
        actors: the rank actors, indexed by global rank.
        attempt_dir: where the per-rank files are created.
    """

    def __init__(self, ray: Any, actors: list[Any], attempt_dir: str) -> None:
        self._ray = ray
        self._actors = actors
        self.stdouts = {r: os.path.join(attempt_dir, f"rank{r}.stdout") for r in range(len(actors))}
        self.stderrs = {r: os.path.join(attempt_dir, f"rank{r}.stderr") for r in range(len(actors))}
        self._files = {}
        for rank in range(len(actors)):
            self._files[rank] = (open(self.stdouts[rank], "ab"), open(self.stderrs[rank], "ab"))
        self._finished: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)

    def start(self) -> OutputPump:
        """Begin fetching in the background."""
        self._thread.start()
        return self

    def finished(self, rank: int) -> bool:
        """True once everything rank ``rank`` wrote is here (or it is gone)."""
        with self._lock:
            return rank in self._finished

    def give_up(self, rank: int) -> None:
        """Stop fetching from ``rank`` (it was stopped)."""
        with self._lock:
            self._finished.add(rank)

    def stop(self) -> None:
        """End the thread and close the files; idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for out, err in self._files.values():
            out.close()
            err.close()

    def _loop(self) -> None:
        ray = self._ray
        in_flight: dict[Any, int] = {}
        busy: set[int] = set()
        while not self._stop.is_set():
            with self._lock:
                wanted = [r for r in range(len(self._actors)) if r not in self._finished]
            for rank in wanted:
                if rank not in busy:
                    in_flight[self._actors[rank].output.remote(_LONG_POLL_S)] = rank
                    busy.add(rank)
            if not in_flight:
                self._stop.wait(0.05)
                continue
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=_LONG_POLL_S)
            for ref in ready:
                rank = in_flight.pop(ref)
                busy.discard(rank)
                try:
                    out, err, events, done = ray.get(ref)
                except Exception:  # noqa: BLE001 - the actor is gone: nothing more will come
                    done, out, err, events = True, b"", b"", []
                self._deliver(rank, out, err, events)
                if done:
                    with self._lock:
                        self._finished.add(rank)
        # Calls still in flight end by themselves within _LONG_POLL_S; their output is
        # only what a stopped rank wrote after the last delivery.

    def _deliver(self, rank: int, out: bytes, err: bytes, batches: list) -> None:
        files = self._files[rank]
        for data, fh in ((out, files[0]), (err, files[1])):
            if data:
                fh.write(data)
                fh.flush()
        if batches:
            from nbtools import events

            bus = events.bus()
            for evs, dropped, source in batches:
                try:
                    bus.publish(list(evs), dropped=dropped, source=source)
                except Exception:  # noqa: BLE001 - a bad batch must not stop the output
                    _log.exception("an events batch from rank %d could not be published", rank)
