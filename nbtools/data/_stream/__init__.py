"""How a stream serves the files: cached paths in order, copies running ahead.

What it holds: :mod:`._stream` (``serve``: the stream that copies ahead on a
thread pool and hands out each path while keeping it from eviction);
:mod:`._spec` (the copy-ahead window and what is said when the cache is too
small for it); :mod:`._freshness` (looking at each file's source ahead of the
consumer); :mod:`._items` (what a stream serves: a slot's files read from the
mapped index); :mod:`._tags` (how a loader learns how far each stream got when
a batch was made).

What it uses: the cache (:mod:`nbtools.data._cache`), the mapped index
(:mod:`nbtools.data._listing`) and the positions of an epoch
(:mod:`nbtools.data._positions`).

Where to start reading: :func:`._stream.serve`, then ``_Stream.run``.
"""

from __future__ import annotations

__all__: list[str] = []
