"""Serving cached paths in order while copies run ahead on a thread pool.

What a stream protects from eviction, and for how long:

* the files copied (or found) ahead of the consumer, until served;
* the path handed out last, until the next one is requested;
* inside a loader (``hold`` is set) whose batches carry the paths themselves,
  every path of the last ``hold + 1`` batches of this process: the batches the
  loader may still have queued, and the one the training loop holds. Paths of
  the final batches stay protected until the next stream of the process starts
  (the loader starts one per epoch) or the process ends.

Protection is a per-file pin, or the cache's gate while no eviction is wanted
(see ``_gate``): a watcher thread converts a gated stream to pins as soon as
another process asks to evict, also while the stream is idle.

The copy-ahead window holds at most ``prefetch`` files and, counting the files
held for the loader, at most ``budget`` bytes (the stream's share of the
cache), but always one file in flight. A consumer that waits for room releases
completed copies from the far end of its own window first.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import IO, Optional

from nbtools._internal.log import get_logger
from nbtools.data import _tags
from nbtools.data._ahead import Ahead, Item, SourceCheck
from nbtools.data._cache import FileCache
from nbtools.data._gate import unwatch, watch
from nbtools.data._pins import Pin, pin_path
from nbtools.data._window import warn_once

__all__ = ["Guard", "Item", "SourceCheck", "serve"]

_log = get_logger("data.stream")
#: Files handed out under the gate between two looks for ones to let go.
_GATED_RELEASE = 16

@dataclass(frozen=True, slots=True)
class Guard:
    """How a complete cached file of a stream is kept from eviction.

    ``pin`` is the file's own pin, or None while the cache's gate protects it
    (nothing evicts then). A file that is not protected at all (a copy ahead
    that gave up) has no guard: the consumer fetches it itself.
    """

    path: str
    pin: Pin | None = None

    @classmethod
    def pinned(cls, pin: Pin) -> Guard:
        """The guard of a pinned file."""
        return cls(pin.path, pin)

    def release(self) -> None:
        """Let the file be evicted again, as far as this guard goes (idempotent)."""
        if self.pin is not None:
            self.pin.release()

    def to_pin(self) -> Guard | None:
        """This guard with a pin of its own (None when the file is gone meanwhile)."""
        if self.pin is not None:
            return self
        pin = pin_path(self.path)
        return None if pin is None else Guard(self.path, pin)


#: A file ahead of the consumer: its copy in flight, its guard, or None (not protected).
_State = Optional[Future | Guard]


def _drop(guard: Guard | None) -> None:
    if guard is not None:
        guard.release()


def _as_guard(pin: Pin | None) -> Guard | None:
    return None if pin is None else Guard(pin.path, pin)


def _settled(state: _State) -> Guard | None:
    """The guard of a finished copy (None for one that failed, was cancelled or runs on)."""
    if not isinstance(state, Future):
        return state
    if state.done() and not state.cancelled() and state.exception() is None:
        return _as_guard(state.result())
    return None


class _Stream:
    def __init__(
        self,
        cache: FileCache,
        chunks: Iterable[list[Item]],
        prefetch: int,
        budget: int,
        hold: int | None,
        open_source: Callable[[int], IO[bytes]],
        stat_source: Callable[[int], tuple[int, int] | None] | None = None,
        check: SourceCheck | None = None,
    ) -> None:
        self.cache = cache
        self.open_source = open_source
        self.stat_source = stat_source
        self.ahead = None if check is None else Ahead(chunks, check)
        self.source: Iterator[Item] = (
            iter(self.ahead) if self.ahead is not None else itertools.chain.from_iterable(chunks)
        )
        self.lookahead: Item | None = None
        self.window = max(1, prefetch)
        self.budget = budget
        self.hold = hold
        self.lock = threading.Lock()
        self.cancel = threading.Event()
        #: [item, state] of files ahead of the consumer, in order.
        self.pending: deque[list] = deque()
        #: (batch index, guard, size) of files handed out and still protected.
        self.held: deque[tuple[int, Guard, int]] = deque()
        self.pending_bytes = 0
        self.held_bytes = 0
        self.pool = ThreadPoolExecutor(
            max_workers=self.window, thread_name_prefix="nbtools-data-copy"
        )
        self.gate_fd = cache.gate.enter()

    # --- protection -------------------------------------------------------------------

    def leave_gate(self) -> None:
        """Pin every file the gate protected, then let the gate go (watcher or end)."""
        with self.lock:
            if self.gate_fd < 0:
                return
            for entry in self.pending:
                if isinstance(entry[1], Guard):
                    entry[1] = entry[1].to_pin()  # None: the consumer fetches it again
            # A handed-out file gone meanwhile needs nothing more.
            self.held = deque(
                (b, pinned, n) for b, g, n in self.held if (pinned := g.to_pin()) is not None
            )
            os.close(self.gate_fd)
            self.gate_fd = -1

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptors, which would keep locks held."""
        fds = [self.gate_fd] if self.gate_fd >= 0 else []
        self.gate_fd = -1
        guards = [e[1] for e in self.pending] + [g for _, g, _ in self.held]
        for guard in guards:
            pin = guard.pin if isinstance(guard, Guard) else None
            if pin is not None and pin._fd >= 0:
                fds.append(pin._fd)
                pin.forget()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _release_served(self) -> None:
        """Drop protection of handed-out files the consumer can no longer be using (locked)."""
        keep_batches = self.hold is not None and _tags.carries_paths() is not False
        oldest_needed = _tags.batches() - (self.hold or 0)
        held = self.held
        while len(held) > 1 and (not keep_batches or held[0][0] < oldest_needed):
            _, guard, size = held.popleft()
            self.held_bytes -= size
            _drop(guard)

    def shed(self) -> None:
        """The consumer waits for room: release the farthest completed copy ahead."""
        with self.lock:
            for entry in reversed(self.pending):
                guard = _settled(entry[1])
                if guard is not None and guard.pin is not None:
                    guard.release()
                    entry[1] = None
                    self.window = max(1, min(self.window, len(self.pending)) - 1)
                    warn_once(
                        self.cache.dir,
                        "the cache at %s is full of files in use; copying ahead at most "
                        "%d files from now on (use a larger cache or fewer workers)",
                        self.cache.dir,
                        self.window,
                    )
                    return

    # --- copy-ahead -------------------------------------------------------------------

    def fill(self) -> None:
        """Start copies (or pin hits) ahead, within the window and the byte budget."""
        while len(self.pending) < self.window:
            item = self.lookahead if self.lookahead is not None else next(self.source, None)
            if item is None:
                return
            if not self._fits(item):
                self.lookahead = item
                return
            self.lookahead = None
            self.submit(item)

    def _fits(self, item: Item) -> bool:
        """Whether ``item`` fits the byte budget; one file in flight is always allowed."""
        return not self.pending or self.pending_bytes + self.held_bytes + item.size <= self.budget

    def _add_gated_hit(self, item: Item) -> bool:
        """Queue ``item`` as a hit under the gate (its path); False when it is not one (locked)."""
        path = self.cache.cached(item.key, item.size, item.mtime_ns)
        if path is None:
            return False
        self.pending.append([item, Guard(path)])
        self.pending_bytes += item.size
        return True

    def submit(self, item: Item) -> None:
        with self.lock:
            if self.gate_fd >= 0:
                if self._add_gated_hit(item):
                    return
            else:
                # A cached file is pinned right here: a thread hand-off costs more than the lookup.
                hit = self.cache.pin_if_cached(item.key, item.size, item.mtime_ns)
                if hit is not None:
                    self.pending.append([item, Guard.pinned(hit)])
                    self.pending_bytes += item.size
                    return
            # Copies ahead of the consumer never wait for room: they give up and
            # let the consumer copy the file itself when it gets there.
            future = self.pool.submit(
                self.cache.fetch_verified,
                item.key,
                item.size,
                item.mtime_ns,
                partial(self.open_source, item.index),
                self.cancel,
                False,
                None,
                self._restat(item),
            )
            self.pending.append([item, future])
            self.pending_bytes += item.size

    def _restat(self, item: Item) -> Callable[[], tuple[int, int] | None] | None:
        return None if self.stat_source is None else partial(self.stat_source, item.index)

    # --- serving ----------------------------------------------------------------------

    def _take_hit(self) -> tuple[str | None, bool]:
        """The usual step of a cached epoch, in few calls (locked).

        When the next file is a hit under the gate, hand it out and look one file
        ahead, adding that one too when it is a hit within the budget. Returns
        ``(path, refilled)``: ``(None, False)`` when the general path must serve
        the next file; ``refilled`` False when :meth:`fill` must look ahead.
        """
        pending = self.pending
        item, state = pending[0]
        if type(state) is not Guard or state.pin is not None:
            return None, False
        pending.popleft()
        self.pending_bytes -= item.size
        path = self._hand_out(item, state)
        if self.gate_fd < 0 or self.lookahead is not None or len(pending) >= self.window:
            return path, False
        ahead = next(self.source, None)
        if ahead is None:
            return path, True
        if self._fits(ahead) and self._add_gated_hit(ahead):
            return path, True
        self.lookahead = ahead  # fill() takes it from here
        return path, False

    def run(self, on_yield: Callable[[], None]) -> Iterator[str]:
        try:
            self.fill()
            pending, lock = self.pending, self.lock
            while pending:
                with lock:
                    path, refilled = self._take_hit()
                    if path is None:
                        item, state = pending.popleft()
                        self.pending_bytes -= item.size
                        if isinstance(state, Guard):
                            # Moved under the lock: a file is always in ``pending`` or
                            # ``held`` where leaving the gate finds it.
                            path = self._hand_out(item, state)
                if path is None:  # a copy ahead still running, given up, or not started
                    pin: Pin | None = state.result() if isinstance(state, Future) else None
                    if pin is None:
                        pin = self.cache.fetch_verified(
                            item.key,
                            item.size,
                            item.mtime_ns,
                            partial(self.open_source, item.index),
                            self.cancel,
                            True,
                            self.shed,
                            self._restat(item),
                        )
                    with lock:
                        path = self._hand_out(item, Guard.pinned(pin))
                if not refilled:
                    self.fill()
                on_yield()
                yield path
        finally:
            self.close()

    def _hand_out(self, item: Item, guard: Guard) -> str:
        """Record ``guard`` as handed out and drop what is no longer needed (locked)."""
        held = self.held
        held.append((_tags.batches(), guard, item.size))
        self.held_bytes += item.size
        if guard.pin is None:
            # Under the gate nothing is pinned, so served files are let go in groups.
            if len(held) % _GATED_RELEASE == 0:
                self._release_served()
        else:
            self._release_served()
        return guard.path

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        self.cancel.set()
        for _, state in self.pending:
            if isinstance(state, Future):
                state.cancel()
        self.pool.shutdown(wait=True)
        defer = self.hold is not None and _tags.carries_paths() is not False
        if defer and self.gate_fd >= 0:
            self.leave_gate()  # deferred files need pins of their own
        with self.lock:
            for _, state in self.pending:
                _drop(_settled(state))
            self.pending.clear()
            held, self.held = self.held, deque()
            if self.gate_fd >= 0:
                os.close(self.gate_fd)
                self.gate_fd = -1
        unwatch(self)
        for _, guard, _ in held:
            if defer and guard.pin is not None:
                _DEFERRED.append(guard.pin)
            else:
                _drop(guard)


# --- per-process bookkeeping ------------------------------------------------------------

#: Pins of the last batches of finished streams, released when the next stream starts.
_DEFERRED: list[Pin] = []
_STREAMS: weakref.WeakSet[_Stream] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The gate's watcher forgets its streams in its own handler (see ``_gate``).
    for stream in list(_STREAMS):
        stream.forget_in_child()
    for pin in _DEFERRED:
        fd = pin._fd
        pin.forget()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _DEFERRED.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def serve(
    cache: FileCache,
    chunks: Iterable[list[Item]],
    open_source: Callable[[int], IO[bytes]],
    prefetch: int,
    on_yield: Callable[[], None],
    budget: int | None = None,
    hold: int | None = None,
    stat_source: Callable[[int], tuple[int, int] | None] | None = None,
    check: SourceCheck | None = None,
) -> Iterator[str]:
    """Yield the cached path of each item, in order, copying up to ``prefetch`` items ahead.

    Args:
        cache: The cache to serve from.
        chunks: The files, in the order to serve them, a list at a time.
        open_source: Opens the source of the file with an item's ``index``, to copy it.
        prefetch: Most files copied ahead of the consumer.
        on_yield: Called just before each path is handed out.
        budget: Most bytes the stream protects at once (one file in flight is
            always allowed); None for no limit.
        hold: Inside a loader whose batches carry paths, how many batches
            before the one being filled the loader may still hold; None outside
            a loader.
        stat_source: ``(size, mtime_ns)`` of the source with an item's index
            now, or None when it cannot be looked at; a copy of a source that
            changed while copied is made again with these (see ``FileCache``).
        check: Gives items their source's size and mtime now, run on a thread
            ahead of the consumer (see ``_ahead``); None trusts the items.

    Closing the generator (or an exception, or Ctrl+C) cancels the copies in
    flight, waits for the copy and check threads, and removes their temporary files.
    """
    return _serve(
        cache, chunks, open_source, prefetch, on_yield, budget, hold, stat_source, check
    )


def _serve(
    cache: FileCache,
    chunks: Iterable[list[Item]],
    open_source: Callable[[int], IO[bytes]],
    prefetch: int,
    on_yield: Callable[[], None],
    budget: int | None,
    hold: int | None,
    stat_source: Callable[[int], tuple[int, int] | None] | None,
    check: SourceCheck | None,
) -> Iterator[str]:
    # A generator: nothing is locked or started before the first path is asked for.
    while _DEFERRED:
        _DEFERRED.pop().release()
    _tags.watch_prefix(cache.dir + os.sep)
    stream = _Stream(
        cache,
        chunks,
        prefetch,
        budget if budget is not None else 1 << 62,
        hold,
        open_source,
        stat_source,
        check,
    )
    _STREAMS.add(stream)
    if stream.gate_fd >= 0:
        watch(stream, cache.gate)
    yield from stream.run(on_yield)
