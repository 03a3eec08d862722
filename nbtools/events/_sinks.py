"""Where a process sends its batches: one small class per transport.

A channel is named by one environment variable, ``NBTOOLS_EVENTS_CHANNEL``,
of the form ``<scheme>:<address>``; the scheme picks the sink class. Local
ranks use ``fifo:<path>``, a named pipe owned by the kernel's ``Collector``.
A second transport (for example through a Ray actor) is one more class with
``send``/``close`` registered in ``SINKS``.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Protocol

__all__ = ["CHANNEL_ENV", "Sink", "FifoSink", "SINKS", "open_sink", "SENT", "FULL", "GONE"]

#: The environment variable that tells a process where its events go.
CHANNEL_ENV = "NBTOOLS_EVENTS_CHANNEL"

#: ``send`` outcomes.
SENT, FULL, GONE = "sent", "full", "gone"


class Sink(Protocol):
    """The sending end of a channel, used by one process's flusher thread.

    ``send`` never blocks: it returns SENT when the batch was taken, FULL when
    the channel cannot take it now (try again later), GONE when nobody reads
    the channel (the batch is lost). Batches are at most ``_wire.BATCH_BYTES``.
    """

    def send(self, batch: bytes) -> str:
        """Hand one batch to the channel."""
        ...

    def close(self) -> None:
        """Release what the sink holds."""
        ...


class FifoSink:
    """Writes batches to the named pipe at ``path``, opened non-blocking.

    A write to a pipe of at most ``PIPE_BUF`` bytes is atomic: it goes in whole
    or fails with EAGAIN when the pipe is full. When nobody reads (the collector
    is stopped) opening fails with ENXIO or ENOENT; the sink tries again at most
    once a second, not on every batch.
    """

    _RETRY_S = 1.0

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError(f"{CHANNEL_ENV} names no pipe: expected fifo:<path>")
        self.path = path
        self._fd: int | None = None
        self._next_try = 0.0

    def _open(self) -> int | None:
        now = time.monotonic()
        if now < self._next_try:
            return None
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT, errno.EACCES, errno.ENOTDIR):
                raise
            self._next_try = now + self._RETRY_S
            return None
        return self._fd

    def send(self, batch: bytes) -> str:
        fd = self._fd if self._fd is not None else self._open()
        if fd is None:
            return GONE
        try:
            os.write(fd, batch)
        except BlockingIOError:
            return FULL
        except (BrokenPipeError, OSError):
            # The reader went away; a new collector may appear at the same path later.
            self.close()
            self._next_try = time.monotonic() + self._RETRY_S
            return GONE
        return SENT

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


SINKS: dict[str, type] = {"fifo": FifoSink}


def open_sink(channel: str) -> Sink:
    """The sink for a channel spec such as ``fifo:/run/dir/events.fifo``.

    Raises:
        ValueError: the spec names no known transport.
    """
    scheme, sep, address = channel.partition(":")
    factory = SINKS.get(scheme) if sep else None
    if factory is None:
        raise ValueError(
            f"{CHANNEL_ENV}={channel!r} names no known transport; expected one of "
            f"{sorted(SINKS)} as '<scheme>:<address>'. Unset it to keep events in this process."
        )
    return factory(address)
