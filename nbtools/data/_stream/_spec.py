"""The copy-ahead window of a stream, and what is said when the cache is too small for it.

Each stream may protect its share of the cache (see ``VolumeDataset``); when
that share holds fewer files than ``prefetch`` asks for, the stream copies
less far ahead and this is reported once per cache directory and process, in
the log and on the run's timeline (a ``cache_full`` event).
"""

from __future__ import annotations

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.data._cache._file_cache import FileCache

__all__ = ["check_window", "warn_once"]

_log = get_logger("data.stream")
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
