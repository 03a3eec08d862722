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

Where to start reading: :class:`._file_cache.FileCache`, then the gate's
protocol in :mod:`._gate`.
"""

from __future__ import annotations

__all__: list[str] = []
