"""``emit`` and ``flush``: where this process's events go.

The route is chosen at the first ``emit`` of each process: when
``NBTOOLS_EVENTS_CHANNEL`` is set (ranks started by ``@distributed`` and their
children), events are buffered and a daemon thread sends them to the kernel;
otherwise (the kernel itself, a plain script) they go straight into this
process's bus. After ``fork`` the child chooses again, with an empty buffer of
its own: the parent's buffered events stay the parent's to send.

Each event names the node it comes from: the host name, unless the process's
environment sets ``NBTOOLS_NODE`` (:data:`NODE_ENV`). The Ray launcher sets it
to the node's label, the host name followed by `` · `` and the start of the
Ray node id where several nodes share a host name, as the GPU pane names
them; the part before `` · `` is always the host name.

Events still buffered when a process ends normally are sent at exit: by
``atexit`` in an interpreter that exits, and by a ``multiprocessing`` finalizer
in a multiprocessing child (loader workers), which skips ``atexit``.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Any

from nbtools._internal import settings
from nbtools._internal.log import get_logger
from nbtools.events import _ask
from nbtools.events._bus import Bus
from nbtools.events._emitter import Emitter
from nbtools.events._record import Event, check_event
from nbtools.events._sinks import CHANNEL_ENV, open_sink
from nbtools.events._wire import Record

__all__ = ["emit", "flush", "BUS", "EXIT_FLUSH_S", "NODE_ENV", "NODE_SEPARATOR", "machine_of"]

_log = get_logger("events")

#: The bus of this process: what the kernel's pane reads.
BUS = Bus()
#: How long a process waits at exit for a full channel to take its last events.
EXIT_FLUSH_S = 3.0
#: The node this process's events name, when set (else the host name).
NODE_ENV = "NBTOOLS_NODE"
#: Between the host name and what tells apart nodes sharing it, in a node label.
NODE_SEPARATOR = " · "

_put: Any = None  # record -> None, chosen at the first emit of this process
_rank: int | None = None  # this process's own rank, stamped on its events
_emitter: Emitter | None = None
_finalizer_pid = 0
_setup_lock = threading.Lock()
_time = time.time


def emit(kind: str, message: str | None = None, **fields: Any) -> None:
    """Record that something happened, from any rank or process; never blocks.

    The event is stamped with the time, host, rank and process id. In a rank
    it is buffered and sent to the kernel in the background; when the buffer
    is full it is dropped and counted, and the kernel learns how many were
    dropped. In the kernel or a plain script it is recorded at once.

    Args:
        kind: What happened: a short name such as ``"eval"``.
        message: Human-readable text; longer than 1000 characters is cut.
        **fields: Numbers, booleans, None or short strings. ``step`` (int) is
            the training step; ``rank`` (int) names the rank the event is
            about, instead of the emitting process's own.

    Raises:
        TypeError: ``kind`` or ``message`` is not a string, or a field is not a
            number, boolean, None or string (tensors: pass ``t.item()``).
        ValueError: ``kind`` is empty or too long, a field is reserved
            (time, host, pid) or the fields hold more than 400 characters.

    Example:
        >>> from nbtools import events
        >>> events.emit("eval", message="val loss 1.93", step=1200, value=1.93)
    """
    kind, message, step, rank, fields = check_event(kind, message, fields)
    put = _put if _put is not None else _setup()
    put((_time(), _rank if rank is ... else rank, kind, message, step, fields))


def flush(timeout: float = EXIT_FLUSH_S) -> bool:
    """Send every event this process has emitted so far; True when all went out.

    Ranks call it at their end (nbtools' launcher does); a process exiting
    normally does it by itself. In a process without a channel it does nothing.

    Args:
        timeout: Longest wait, in seconds, for a channel that is full.
    """
    emitter = _emitter
    if emitter is None:
        return True
    return emitter.flush(timeout)


def machine_of(node: str) -> str:
    """The host name in a node label (``"gpu-a · 1a2b3c4d"`` -> ``"gpu-a"``)."""
    return node.split(NODE_SEPARATOR, 1)[0]


def _own_node() -> str:
    return settings.read(NODE_ENV) or socket.gethostname()


def _own_rank() -> int | None:
    value = os.environ.get("RANK", "")
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _setup() -> Any:
    global _put, _rank, _emitter
    with _setup_lock:
        if _put is not None:
            return _put
        pid, host, rank = os.getpid(), _own_node(), _own_rank()
        channel = settings.read(CHANNEL_ENV)
        sink = None
        if channel:
            try:
                sink = open_sink(channel)
            except ValueError as exc:
                _log.warning("%s; events of this process stay in it", exc)
        if sink is None:
            put = _local_put(host, pid)
        else:
            _emitter = Emitter(sink, host, pid, rank)
            put = _emitter.put
            ask = _ask.ask_path(channel or "")
            if ask is not None:  # answer the watchdog's "which collective are you in?"
                _emitter.add_source(_ask.Answerer(ask, rank))
            _flush_when_process_ends(pid)
        _rank = rank
        _put = put
        return put


def _local_put(host: str, pid: int) -> Any:
    publish = BUS.publish_one

    def put(record: Record) -> None:
        t, rank, kind, message, step, fields = record
        publish(Event(t, host, rank, pid, kind, message, step, fields or {}))

    return put


def _flush_when_process_ends(pid: int) -> None:
    global _finalizer_pid
    if _finalizer_pid == pid:
        return
    _finalizer_pid = pid
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        # A multiprocessing child leaves through os._exit after running these
        # finalizers, never through atexit. Registered here, not at fork: the
        # child clears the registry after the fork hooks have run.
        util.Finalize(None, _exit_flush, exitpriority=10)


def _exit_flush() -> None:
    try:
        flush(EXIT_FLUSH_S)
    except Exception:  # noqa: BLE001 - never turn a clean exit into a failure
        _log.debug("flushing events at exit failed", exc_info=True)


def _after_fork_in_child() -> None:
    global _put, _rank, _emitter, _setup_lock
    _setup_lock = threading.Lock()
    BUS._after_fork()
    if _emitter is not None:
        _emitter.abandon()
    _emitter = None
    _put = None
    _rank = None


atexit.register(_exit_flush)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
