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
(see ``_cache._gate``): a watcher thread converts a gated stream to pins as soon as
another process asks to evict, also while the stream is idle.

The copy-ahead window holds at most ``prefetch`` files and, counting the files
held for the loader, at most ``budget`` bytes (the stream's share of the
cache), but always one file in flight. A consumer that waits for room releases
completed copies from the far end of its own window first.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.data._cache import Guard, Pin, drop, settled, to_pin, unwatch, watch
from nbtools.data._stream import _tags
from nbtools.data._stream._freshness import Ahead
from nbtools.data._stream._items import Item
from nbtools.data._stream._spec import StreamSpec, warn_once

__all__ = ["serve"]

_log = get_logger("data.stream")
#: Files handed out under the gate between two looks for ones to let go.
_GATED_RELEASE = 16
#: Most files of one run of cached files taken at once.
_RUN_MOST = 4096


class _Stream:
    def __init__(self, spec: StreamSpec, chunks: Iterable[list[Item]]) -> None:
        cache, check = spec.cache, spec.check
        self.cache = cache
        self.open_source = spec.open_source
        self.stat_source = spec.stat_source
        self.count = spec.count
        self.on_yield = spec.on_yield
        self.ahead = None if check is None else Ahead(chunks, check)
        self.chunks: Iterator[list[Item]] = (
            self.ahead.chunks() if self.ahead is not None else iter(chunks)
        )
        #: The chunk being taken from, and the position of its next item.
        self.buf: list[Item] = []
        self.pos = 0
        #: An item taken from ``buf`` (always ``buf[pos - 1]``) that waits for room.
        self.lookahead: Item | None = None
        self.window = max(1, spec.prefetch)
        self.budget = spec.budget if spec.budget is not None else 1 << 62
        self.hold = spec.hold
        self.lock = threading.Lock()
        self.cancel = threading.Event()
        #: [item, state] of files ahead of the consumer, in order.
        self.pending: deque[list[Any]] = deque()
        #: Copies in flight among ``pending``.
        self.copies = 0
        #: (batch index, guard, size) of files handed out and still protected; the
        #: guard of a file the gate protects may be its bare path.
        self.held: deque[tuple[int, Guard | str, int]] = deque()
        self.pending_bytes = 0
        self.held_bytes = 0
        self.pool = ThreadPoolExecutor(
            max_workers=self.window, thread_name_prefix="nbtools-data-copy"
        )
        self.gate_fd = cache.gate.enter()

    def _next_item(self) -> Item | None:
        """The next item of the chunks, or None at their end."""
        while self.pos >= len(self.buf):
            chunk = next(self.chunks, None)
            if chunk is None:
                return None
            self.buf, self.pos = chunk, 0
        item = self.buf[self.pos]
        self.pos += 1
        return item

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
                (b, pinned, n) for b, g, n in self.held if (pinned := to_pin(g)) is not None
            )
            os.close(self.gate_fd)
            self.gate_fd = -1

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptors, which would keep locks held."""
        fds = [self.gate_fd] if self.gate_fd >= 0 else []
        self.gate_fd = -1
        guards = [e[1] for e in self.pending] + [g for _, g, _ in self.held]  # Guard | str
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
            drop(guard)

    def shed(self) -> None:
        """The consumer waits for room: release the farthest completed copy ahead."""
        with self.lock:
            for entry in reversed(self.pending):
                guard = settled(entry[1])
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
        """Start copies (or pin hits) ahead, within the window and the byte budget.

        Under the gate, with no copy in flight, a cached file stops the filling:
        the run of cached files from there is served by :meth:`_take_run`.
        """
        while len(self.pending) < self.window:
            item = self.lookahead if self.lookahead is not None else self._next_item()
            if item is None:
                return
            self.lookahead = item
            if not self._fits(item):
                return
            if (
                self.copies == 0
                and self.pending
                and self.gate_fd >= 0
                and self.cache.cached(item.key, item.size, item.mtime_ns) is not None
            ):
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
            self.copies += 1
            future = self.pool.submit(
                self.cache.fetch,
                item.key,
                item.size,
                item.mtime_ns,
                partial(self.open_source, item.source),
                self.cancel,
                wait_for_space=False,
                restat=self._restat(item),
            )
            self.pending.append([item, future])
            self.pending_bytes += item.size

    def _restat(self, item: Item) -> Callable[[], tuple[int, int] | None] | None:
        return None if self.stat_source is None else partial(self.stat_source, item.source)

    # --- serving ----------------------------------------------------------------------

    def _take_run(self) -> tuple[list[Item], list[str]]:
        """The next files while they are cached and fit, with their paths (locked).

        A cached epoch is served from here: one lookup per file in the memo of
        complete files, and nothing ahead of the consumer to keep track of.
        The run stops before the last ``window`` cached files ahead of a file
        to copy, so that the general path starts that copy while it serves
        them. Call only with ``pending`` empty and the gate held.
        """
        if self.lookahead is not None:
            self.lookahead = None
            self.pos -= 1  # it is buf[pos - 1]: take it again
        cached = self.cache.cached
        known = self.cache.known.entries() or {}
        under = self.cache.dir + os.sep
        run: list[Item] = []
        paths: list[str] = []
        room = self.budget - self.held_bytes
        while len(run) < _RUN_MOST:
            buf, i = self.buf, self.pos
            end = len(buf)
            while i < end:
                item = buf[i]
                if run and item.size > room:
                    break
                key = item.key
                if known.get(key) == (item.size, item.mtime_ns):
                    path = under + key  # the memo: seen complete since the last eviction
                else:
                    found = cached(key, item.size, item.mtime_ns)
                    if found is None:
                        break
                    path = found
                room -= item.size
                run.append(item)
                paths.append(path)
                i += 1
            if i < end:
                back = min(self.window, len(run)) if item.size <= room else 0
                if back <= i - self.pos:
                    self.pos = i - back
                else:  # some of them came from the chunk before this one
                    self.buf, self.pos = run[-back:] + buf[i:], 0
                if back:
                    del run[-back:], paths[-back:]
                return run, paths
            self.pos = i
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            self.buf, self.pos = chunk, 0
        return run, paths

    def _serve_run(self, run: list[Item], paths: list[str]) -> Iterator[str]:
        """Hand out the files of a run from :meth:`_take_run` (cached, under the gate)."""
        held, count, on_yield = self.held, self.count, self.on_yield
        acquire, release = self.lock.acquire, self.lock.release  # cheaper than ``with``
        batches, carries = _tags.batches, _tags.carries_paths
        keep = self.hold is not None
        for k, path in enumerate(paths):
            size = run[k].size
            acquire()
            try:
                if self.gate_fd < 0 or held is not self.held:
                    # The gate was left meanwhile: what is left of the run was never
                    # pinned, so it is looked up again the general way.
                    self.buf = run[k:] + self.buf[self.pos :]
                    self.pos = 0
                    return
                if keep and carries() is not False:
                    # The loader's batches hold the paths: keep those it may hold.
                    held.append((batches(), path, size))
                    self.held_bytes += size
                    if len(held) % _GATED_RELEASE == 0:
                        self._release_served()
                elif len(held) == 1 and (last := held[0])[1].__class__ is str:
                    # Only the path handed out last needs keeping: this one, now.
                    held[0] = (0, path, size)
                    self.held_bytes += size - last[2]
                else:
                    while held:
                        _, guard, was = held.popleft()
                        self.held_bytes -= was
                        drop(guard)
                    held.append((0, path, size))
                    self.held_bytes += size
            finally:
                release()
            count.n += 1
            if on_yield is not None:
                on_yield()
            yield path

    def _take_hit(self) -> tuple[str | None, bool]:
        """The usual step of the general path for a cached file, in few calls (locked).

        When the next file is a hit under the gate, hand it out and look one file
        ahead, adding that one too when it is a hit within the budget and a copy
        is still in flight. Returns ``(path, refilled)``: ``(None, False)`` when
        the general path must serve the next file; ``refilled`` False when
        :meth:`fill` must look ahead.
        """
        pending = self.pending
        item, state = pending[0]
        if type(state) is not Guard or state.pin is not None:
            return None, False
        pending.popleft()
        self.pending_bytes -= item.size
        path = self._hand_out(item, state)
        if (
            self.gate_fd < 0
            or self.lookahead is not None
            or len(pending) >= self.window
            or self.copies == 0
        ):
            return path, False
        ahead = self._next_item()
        if ahead is None:
            return path, True
        if self._fits(ahead) and self._add_gated_hit(ahead):
            return path, True
        self.lookahead = ahead  # fill() takes it from here
        return path, False

    def run(self) -> Iterator[str]:
        try:
            pending, lock = self.pending, self.lock
            while True:
                if not pending and self.gate_fd >= 0:
                    with lock:
                        run, paths = (
                            self._take_run() if self.gate_fd >= 0 and not pending else ([], [])
                        )
                    if run:
                        yield from self._serve_run(run, paths)
                        continue
                self.fill()
                if not pending:
                    return
                with lock:
                    path, refilled = self._take_hit()
                    if path is None:
                        item, state = pending.popleft()
                        self.pending_bytes -= item.size
                        if isinstance(state, Future):
                            self.copies -= 1
                        elif isinstance(state, Guard):
                            # Moved under the lock: a file is always in ``pending`` or
                            # ``held`` where leaving the gate finds it.
                            path = self._hand_out(item, state)
                if path is None:  # a copy ahead still running, given up, or not started
                    pin: Pin | None = state.result() if isinstance(state, Future) else None
                    if pin is None:
                        pin = self.cache.fetch(
                            item.key,
                            item.size,
                            item.mtime_ns,
                            partial(self.open_source, item.source),
                            self.cancel,
                            on_wait=self.shed,
                            restat=self._restat(item),
                        )
                        assert pin is not None  # it waits for room: never None
                    with lock:
                        path = self._hand_out(item, Guard.pinned(pin))
                if not refilled:
                    self.fill()
                self.count.n += 1
                if self.on_yield is not None:
                    self.on_yield()
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
                drop(settled(state))
            self.pending.clear()
            held, self.held = self.held, deque()
            if self.gate_fd >= 0:
                os.close(self.gate_fd)
                self.gate_fd = -1
        unwatch(self)
        for _, guard, _ in held:
            if defer and isinstance(guard, Guard) and guard.pin is not None:
                _DEFERRED.append(guard.pin)
            else:
                drop(guard)


# --- per-process bookkeeping ------------------------------------------------------------

#: Pins of the last batches of finished streams, released when the next stream starts.
_DEFERRED: list[Pin] = []
_STREAMS: weakref.WeakSet[_Stream] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The gate's watcher forgets its streams in its own handler (see ``_cache._gate``).
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


def serve(spec: StreamSpec, chunks: Iterable[list[Item]]) -> Iterator[str]:
    """Yield the cached path of each item, in order, copying up to ``spec.prefetch`` ahead.

    ``chunks``: the files, in the order to serve them, a list at a time.
    Closing the generator (or an exception, or Ctrl+C) cancels the copies in
    flight, waits for the copy and check threads, and removes their temporary files.
    """
    # A generator: nothing is locked or started before the first path is asked for.
    while _DEFERRED:
        _DEFERRED.pop().release()
    _tags.watch_prefix(spec.cache.dir + os.sep)
    stream = _Stream(spec, chunks)
    _STREAMS.add(stream)
    if stream.gate_fd >= 0:
        watch(stream, spec.cache.gate)
    yield from stream.run()
