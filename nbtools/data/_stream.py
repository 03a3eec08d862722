"""Serving cached paths in order while copies run ahead on a thread pool."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from nbtools.data._cache import FileCache, Pin

__all__ = ["Item", "serve"]


@dataclass(frozen=True)
class Item:
    """One file to serve: its cache key, listed size and mtime, and how to open its source."""

    key: str
    size: int
    mtime_ns: int
    opener: Callable[[], IO[bytes]]


def _release(ahead: Future | Pin) -> None:
    if isinstance(ahead, Pin):
        ahead.release()
        return
    future = ahead
    if future.done() and not future.cancelled() and future.exception() is None:
        pin = future.result()
        if pin is not None:
            pin.release()


def serve(
    cache: FileCache, items: Iterable[Item], prefetch: int, on_yield: Callable[[], None]
) -> Iterator[str]:
    """Yield the cached path of each item, in order, copying up to ``prefetch`` items ahead.

    The path last yielded stays pinned (not evictable) until the next one is
    requested; the items copied ahead are pinned until served. ``on_yield`` is
    called just before each path is handed out. Closing the generator (or an
    exception, or Ctrl+C) cancels the copies in flight, waits for the copy
    threads, and removes their temporary files.
    """
    cancel = threading.Event()
    source = iter(items)
    pending: deque[tuple[Item, Future | Pin]] = deque()
    pool = ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="nbtools-data-copy")

    def submit() -> bool:
        item = next(source, None)
        if item is None:
            return False
        # A cached file is pinned right here: a thread hand-off costs more than the lookup.
        hit = cache.pin_if_cached(item.key, item.size, item.mtime_ns)
        if hit is not None:
            pending.append((item, hit))
            return True
        # Copies ahead of the consumer never wait for room: they give up and
        # let the consumer copy the file itself when it gets there.
        future = pool.submit(
            cache.fetch, item.key, item.size, item.mtime_ns, item.opener, cancel, False
        )
        pending.append((item, future))
        return True

    current: Pin | None = None
    try:
        while len(pending) < max(1, prefetch) and submit():
            pass
        while pending:
            item, ahead = pending.popleft()
            submit()
            pin = ahead if isinstance(ahead, Pin) else ahead.result()
            if pin is None:
                pin = cache.fetch(item.key, item.size, item.mtime_ns, item.opener, cancel, True)
            if current is not None:
                current.release()
            current = pin
            on_yield()
            yield pin.path
    finally:
        cancel.set()
        for _, ahead in pending:
            if isinstance(ahead, Future):
                ahead.cancel()
        pool.shutdown(wait=True)
        for _, ahead in pending:
            _release(ahead)
        if current is not None:
            current.release()
