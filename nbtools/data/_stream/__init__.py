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
(:mod:`nbtools.data._positions`), the first two through their front doors. The dataset and
the loader enter this room through this ``__init__`` only.

Where to start reading: :func:`._stream.serve`, then ``_Stream.run``.
"""

from __future__ import annotations

from nbtools.data._stream._freshness import SourceCheck
from nbtools.data._stream._items import Item, check_mode, slot_items
from nbtools.data._stream._spec import StreamSpec, check_window
from nbtools.data._stream._stream import serve
from nbtools.data._stream._tags import Tagged, TaggingCollate, track

__all__ = [
    "Item",
    "SourceCheck",
    "StreamSpec",
    "TaggingCollate",
    "Tagged",
    "check_mode",
    "check_window",
    "serve",
    "slot_items",
    "track",
]
