"""Ranged reads of checkpoint files into local staging, watched for stalls.

A rank fetches only the byte ranges its load plan names: ``pread`` on a
mounted directory, ranged GETs (fsspec ``cat_file(start, end)``) on an object
store. A range larger than ``chunk_size`` is fetched as parallel pieces of
about ``chunk_size`` bytes (never smaller than ``min_chunk_size``). Each range
lands at its own offset in a sparse staging file of the same name, so the
staged file reads like the original one wherever the plan looks.

The fetches run on daemon threads of a :class:`FetchPool`. A wait on one of
them raises :class:`~nbtools.errors.CheckpointStallError` when the pool made no
progress for ``read_timeout`` seconds; the error names the file, the byte
range, the rank and the host. On an async fsspec filesystem the request itself
is cancelled then; a ``pread`` stuck in a hung mount cannot be, and its daemon
thread ends when the mount answers or goes away (it never blocks the
interpreter's exit and never writes into a file of a later load).
"""

from __future__ import annotations

import functools
import os
import queue
import socket
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from nbtools.checkpoint._storage._target import Target
from nbtools.errors import CheckpointStallError

__all__ = ["split", "FetchPool", "fetch_range", "crc32_of", "stall_message"]

#: Bytes moved per system call on a mount, so that progress is seen often.
_BLOCK = 8 << 20
#: Bytes per ranged request to an object store (fewer, larger requests cost less there).
_REQUEST = 64 << 20


def split(length: int, chunk_size: int, min_chunk_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of a range: about ``chunk_size`` each, none under
    ``min_chunk_size`` (a range below twice that stays whole)."""
    if length < 2 * min_chunk_size or length <= chunk_size:
        return [(0, length)]
    count = max(1, -(-length // chunk_size))
    count = min(count, max(1, length // min_chunk_size))
    step = -(-length // count)
    return [(at, min(step, length - at)) for at in range(0, length, step)]


def stall_message(rank: int, name: str, start: int, end: int, where: str, timeout: float) -> str:
    """The text of a stall error: file, byte range, rank, host and what to do."""
    return (
        f"reading {name} bytes {start}..{end} of {where} on rank {rank} "
        f"(host {socket.gethostname()}) made no progress for {timeout:g} s: the volume "
        "stopped answering (a hung mount or an object store that does not respond). The "
        "load did not finish: the state it was loading into may hold part of it, so do not "
        "use it. Check the volume from that host, then load again (restore from scratch); "
        "if the volume is only slow, raise read_timeout="
    )


class _Task:
    __slots__ = ("fn", "future", "what", "started", "last")

    def __init__(self, fn: Callable[[Callable[[int], None]], Any], what: tuple[str, int, int]):
        self.fn, self.what = fn, what
        self.future: Future[Any] = Future()
        self.started: float | None = None
        self.last = 0.0


class FetchPool:
    """Daemon worker threads running fetches in submission order, with a stall watch.

    Args:
        threads: Workers.
        read_timeout: Seconds without progress after which a wait fails.
        rank: This rank, for error messages.
        where: The checkpoint, for error messages.
        on_bytes: Called with each block's byte count as it arrives (progress).
    """

    def __init__(
        self,
        threads: int,
        read_timeout: float,
        rank: int,
        where: str,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.read_timeout = read_timeout
        self.rank, self.where = rank, where
        self._on_bytes = on_bytes
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: set[_Task] = set()
        self._last = time.monotonic()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"nbtools-ckpt-read-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[[Callable[[int], None]], Any], what: tuple[str, int, int]
    ) -> Future[Any]:
        """Run ``fn(progress)``; ``what`` is ``(file, start, end)`` for a stall error."""
        task = _Task(fn, what)
        task.future.nbtools_what = what  # type: ignore[attr-defined]
        self._queue.put(task)
        return task.future

    def _progress(self, task: _Task, nbytes: int) -> None:
        now = time.monotonic()
        task.last = self._last = now
        if self._on_bytes is not None and nbytes:
            self._on_bytes(nbytes)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            if self._closed or not task.future.set_running_or_notify_cancel():
                continue
            with self._lock:
                task.started = task.last = self._last = time.monotonic()
                self._running.add(task)
            try:
                result = task.fn(functools.partial(self._progress, task))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                task.future.set_exception(exc)
            else:
                task.future.set_result(result)
            finally:
                with self._lock:
                    self._running.discard(task)
                    self._last = time.monotonic()

    def wait(self, future: Future[Any]) -> Any:
        """The result of ``future``; raises its error, or a stall error after
        ``read_timeout`` seconds in which no fetch of the pool moved a byte."""
        begun = time.monotonic()
        while True:
            try:
                return future.result(timeout=min(1.0, self.read_timeout))
            except TimeoutError:
                if future.done():  # the fetch's own error (a stall error is a TimeoutError)
                    raise
            now = time.monotonic()
            with self._lock:
                quiet = now - max(self._last, begun)
                running = sorted(self._running, key=lambda t: t.last)
            if quiet >= self.read_timeout and not future.done():
                stuck = running[0].what if running else getattr(future, "nbtools_what", None)
                name, start, end = stuck or ("a file", 0, 0)
                raise CheckpointStallError(
                    stall_message(self.rank, name, start, end, self.where, self.read_timeout)
                )

    def close(self) -> None:
        """Cancel what has not started and let the workers go (a stuck one ends later)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=0.0 if self._running else 5.0)


def _crcs(data: bytes, at: int, cuts: list[int]) -> list[tuple[int, int, int]]:
    """``(offset, length, crc32)`` of ``data`` (at file offset ``at``), cut at ``cuts``."""
    view = memoryview(data)
    bounds = [at, *(c for c in cuts if at < c < at + len(data)), at + len(data)]
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    return [(a, b - a, zlib.crc32(view[a - at : b - at])) for a, b in pairs]


def fetch_range(
    target: Target,
    name: str,
    start: int,
    length: int,
    dest: str,
    timeout: float,
    progress: Callable[[int], None],
    cuts: list[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Copy bytes ``[start, start + length)`` of the file ``name`` to the same offset of
    the local file ``dest`` (created if absent), block by block.

    Returns:
        ``(offset, length, crc32)`` of the blocks copied, each cut at the file offsets
        ``cuts`` (record boundaries), so that a record's CRC-32 can be assembled from
        them (:func:`crc32_of`) without reading it again.
    """
    cuts = sorted(cuts or [])
    blocks: list[tuple[int, int, int]] = []
    # Mounts: small blocks, so that progress shows often; stores: fewer, larger requests.
    piece = _BLOCK if target.local_path is not None else _REQUEST
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = 0
        while done < length:
            n = min(piece, length - done)
            data = target.read_range(name, start + done, start + done + n, timeout)
            if len(data) != n:
                raise EOFError(f"{name} ends before byte {start + length}")
            os.pwrite(fd, data, start + done)
            blocks += _crcs(data, start + done, cuts)
            done += n
            progress(n)
        return blocks
    finally:
        os.close(fd)


def _times(mat: tuple[int, ...], vec: int) -> int:
    total, i = 0, 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, m) for m in mat)


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator taking a CRC-32 over ``nbytes`` more zero bytes (zlib's
    ``crc32_combine``, as a matrix, so that each length is worked out once)."""
    odd = (0xEDB88320, *(1 << n for n in range(31)))  # one zero bit
    even = _square(odd)  # two
    odd = _square(even)  # four
    result = tuple(1 << n for n in range(32))
    while nbytes:
        even = _square(odd)
        if nbytes & 1:
            result = tuple(_times(even, r) for r in result)
        nbytes >>= 1
        if not nbytes:
            break
        odd = _square(even)
        if nbytes & 1:
            result = tuple(_times(odd, r) for r in result)
        nbytes >>= 1
    return result


def crc32_of(blocks: list[tuple[int, int, int]], offset: int, length: int) -> int | None:
    """The CRC-32 of bytes ``[offset, offset + length)`` from the blocks covering them
    exactly (from :func:`fetch_range`); None when they do not."""
    inside = sorted(b for b in blocks if offset <= b[0] and b[0] + b[1] <= offset + length)
    crc, at = 0, offset
    for start, n, block_crc in inside:
        if start != at:
            return None
        crc = _times(_shift(n), crc) ^ block_crc
        at += n
    return crc if at == offset + length else None
