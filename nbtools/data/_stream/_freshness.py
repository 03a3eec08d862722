"""Looking at the sources of the files a stream serves, on a thread ahead of the consumer.

A cached copy is served only when it matches its source as the source is now
(size and mtime), so a file rewritten in place on the volume is copied again,
never served stale, even between epochs and under an index reused from an
earlier launch (whose directory check cannot see such a rewrite). That takes
one ``stat`` per file and epoch. On a FUSE or network volume it is the slowest
step of a cached epoch, so it does not run where the consumer waits: a thread
of the stream takes the stream's items a chunk at a time, ``fstatat``\\ s each
source from a descriptor of the root (no path walk through the mount), and
queues the checked chunk at most ``depth`` chunks ahead of the consumer. The
consumer takes whole chunks and never waits on the volume's metadata while
the thread keeps ahead; the thread waits in the kernel with the GIL released.

What is checked ahead is at most ``depth`` chunks old when served; a copy made
later still compares the source before and after it reads it (see
``_cache._file_cache``), so a source that changes after its check is never served partial.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator

from nbtools.data._stream._items import Item

__all__ = ["Ahead", "SourceCheck"]


class SourceCheck:
    """Gives each item its source's size and mtime now.

    Args:
        root: The dataset root (a local directory or mount).
        skip: Characters of an item's key before its path relative to ``root``.

    A source that cannot be looked at (gone, or an unmounted volume) keeps
    the listed values: it is served from the cache as listed.
    """

    def __init__(self, root: str, skip: int) -> None:
        self.root = root
        self.skip = skip
        self._fd = -2  # -2: not opened yet, -1: the root cannot be opened

    def _root_fd(self) -> int:
        if self._fd == -2:
            try:
                self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1
        return self._fd

    def __call__(self, chunk: list[Item]) -> list[Item]:
        fd = self._root_fd()
        if fd < 0:
            return chunk
        stat, skip = os.stat, self.skip
        out = []
        for item in chunk:
            try:
                st = stat(item.key[skip:], dir_fd=fd)
            except OSError:
                out.append(item)
                continue
            if st.st_size == item.size and st.st_mtime_ns == item.mtime_ns:
                out.append(item)
            else:
                out.append(Item(item.key, st.st_size, st.st_mtime_ns, item.source))
        return out

    def close(self) -> None:
        """Close the root's descriptor (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class Ahead:
    """The items of ``chunks``, checked by ``check`` on a thread at most ``depth`` chunks ahead.

    Iterate it once, from one thread; :meth:`close` stops and joins the thread
    (also when the consumer stops early). An error of the chunks or the check
    is raised in the consumer, at the item where it happened.
    """

    def __init__(self, chunks: Iterable[list[Item]], check: SourceCheck, depth: int = 2) -> None:
        self._chunks = iter(chunks)
        self._check = check
        self._depth = depth
        self._cond = threading.Condition()
        self._ready: deque[list[Item]] = deque()
        self._done = False
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nbtools-data-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cond, ready = self._cond, self._ready
        try:
            for chunk in self._chunks:
                checked = self._check(chunk)
                with cond:
                    while len(ready) >= self._depth and not self._stop:
                        cond.wait()
                    if self._stop:
                        return
                    ready.append(checked)
                    cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._error = exc
        finally:
            self._check.close()
            with cond:
                self._done = True
                cond.notify_all()

    def chunks(self) -> Iterator[list[Item]]:
        """The checked chunks, in order, each as soon as the thread has checked it."""
        cond, ready = self._cond, self._ready
        while True:
            with cond:
                while not ready and not self._done:
                    cond.wait()
                if not ready:
                    break
                chunk = ready.popleft()
                cond.notify_all()
            yield chunk
        if self._error is not None:
            raise self._error

    def __iter__(self) -> Iterator[Item]:
        for chunk in self.chunks():
            yield from chunk

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
