"""Where copies live: the node's file cache, shared by every worker and rank on it.

What it holds: :mod:`._file_cache` (``FileCache``: complete copies under their
final name only, room made by evicting the oldest download, space held by
other files told apart); :mod:`._location` (where the cache lives, how much it
keeps free, the checks that keep it private); :mod:`._gate` (one shared lock
that stands in for per-file pins while nothing evicts); :mod:`._pins` (what
keeps a file in use from eviction: pins, and a stream's guards); :mod:`._sweep`
(walking the cache: eviction candidates and leftover temporaries).

What it uses: the standard library and ``nbtools._internal``; nothing else of
``nbtools.data``, which builds on it.

The rest of ``nbtools.data`` enters through this ``__init__`` only: the cache and its
location for the dataset, the privacy check for the listing's index, the gate's watch and
the guards for a stream.

Where to start reading: :class:`._file_cache.FileCache`, then the gate's
protocol in :mod:`._gate`.
"""

from __future__ import annotations

from nbtools.data._cache._file_cache import FileCache
from nbtools.data._cache._gate import unwatch, watch
from nbtools.data._cache._location import ENV_DIR, default_cache_dir, ensure_private_dir
from nbtools.data._cache._pins import Guard, Pin, drop, settled, to_pin

__all__ = [
    "ENV_DIR",
    "FileCache",
    "Guard",
    "Pin",
    "default_cache_dir",
    "drop",
    "ensure_private_dir",
    "settled",
    "to_pin",
    "unwatch",
    "watch",
]
