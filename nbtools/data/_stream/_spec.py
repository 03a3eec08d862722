"""What a stream is asked to do (:class:`StreamSpec`), and its copy-ahead window.

Each stream may protect its share of the cache (see ``VolumeDataset``); when
that share holds fewer files than ``prefetch`` asks for, the stream copies
less far ahead and this is reported once per cache directory and process, in
the log and on the run's timeline (a ``cache_full`` event).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.data._cache import FileCache

if TYPE_CHECKING:
    from nbtools.data._stream._freshness import SourceCheck
    from nbtools.data._stream._tags import Count

__all__ = ["StreamSpec", "check_window", "warn_once"]

_log = get_logger("data.stream")


@dataclass(frozen=True)
class StreamSpec:
    """How one stream serves its items (see :func:`~nbtools.data._stream._stream.serve`).

    Attributes:
        cache: The cache to serve from.
        open_source: Opens the source of the file with an item's ``index``, to copy it.
        prefetch: Most files copied ahead of the consumer.
        count: Counts the paths handed out (``count.n``), before each is.
        on_yield: Called just before each path is handed out, after ``count``.
        budget: Most bytes the stream protects at once (one file in flight is
            always allowed); None for no limit.
        hold: Inside a loader whose batches carry paths, how many batches
            before the one being filled the loader may still hold; None outside
            a loader.
        stat_source: ``(size, mtime_ns)`` of the source with an item's index
            now, or None when it cannot be looked at; a copy of a source that
            changed while copied is made again with these (see ``FileCache``).
        check: Gives items their source's size and mtime now, run on a thread
            ahead of the consumer (see ``_freshness``); None trusts the items.
    """

    cache: FileCache
    open_source: Callable[[int], IO[bytes]]
    prefetch: int
    count: Count
    on_yield: Callable[[], None] | None = None
    budget: int | None = None
    hold: int | None = None
    stat_source: Callable[[int], tuple[int, int] | None] | None = None
    check: SourceCheck | None = None


#: Cache directories whose too-small window this process already reported.
_WARNED: set[str] = set()


def warn_once(cache_dir: str, message: str, *args: object) -> None:
    """Log a warning about the copy-ahead window of ``cache_dir``, once per process.

    The same goes to the run's timeline as a ``cache_full`` event.
    """
    if cache_dir not in _WARNED:
        _WARNED.add(cache_dir)
        _log.warning(message, *args)
        events.emit("cache_full", message=message % args, cache_dir=cache_dir[-200:])


def check_window(cache: FileCache, budget: int, largest: int, prefetch: int) -> None:
    """Warn (once) when ``budget`` bytes per stream hold fewer than ``prefetch`` files ahead."""
    fits = budget // max(1, largest) - 1  # less the path handed out last
    if fits < prefetch:
        warn_once(
            cache.dir,
            "the cache at %s holds about %d files of up to %d bytes for each of the streams "
            "on this node (%d bytes usable, %d kept free); copying ahead %d files instead "
            "of prefetch=%d. A larger cache filesystem, a lower min_free_bytes or fewer "
            "workers let it copy further ahead",
            cache.dir,
            max(0, fits + 1),
            largest,
            cache.capacity,
            cache.min_free,
            max(1, fits),
            prefetch,
        )
