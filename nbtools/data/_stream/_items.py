"""What a stream serves: :class:`Item`, one file, and a slot's files in chunks of items
read from the mapped index."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from itertools import islice
from typing import NamedTuple

import numpy as np

from nbtools.data._listing import Index, namespace
from nbtools.data._positions import Order

__all__ = ["Item", "check_mode", "slot_items"]


class Item(NamedTuple):
    """One file to serve: its cache key, size and mtime to expect, and its source's index in
    the listing.

    The stream opens the source (``open_source(source)``) only when it copies the file.
    """

    key: str
    size: int
    mtime_ns: int
    source: int  # index of the source file in the listing


#: Items handed to a stream (and checked against their sources) at a time.
_ITEMS_PER_CHUNK = 256


def check_mode(value: object) -> str:
    """The source-check mode named by ``check_sources``: ``launch``, ``epoch`` or ``never``."""
    if isinstance(value, bool):
        return "epoch" if value else "never"
    if value in ("launch", "epoch"):
        return value
    raise ValueError(
        "check_sources must be 'launch' (each source once per launch), 'epoch' (every epoch; "
        f"also True) or False (never), got {value!r}"
    )


def slot_items(files: Index, order: Order, chunks: Iterable[np.ndarray]) -> Iterator[list[Item]]:
    """The files at a slot's positions (``chunks``, int64 arrays of positions in serving
    order), in chunks of items, with their listed size and mtime.

    Works from the mapped index a chunk at a time: positions, the shuffle
    and the lookups are array operations, and nothing is built per file of
    the dataset, only per file served.
    """
    prefix = namespace(files.root) + "/"
    offsets, sizes, mtimes = files.columns()
    blob, start = files.map, files.paths_start
    make = partial(tuple.__new__, Item)  # an Item without a Python-level __new__
    # Blocks of positions grow to thousands (a call of the shuffle costs about
    # as much for one position as for thousands); items go out 256 at a time.
    for positions in chunks:
        index = order.at(positions)
        starts = (offsets[index] + start).tolist()
        ends = (offsets[index + 1] + start).tolist()
        keys = [
            prefix + blob[a:b].decode("utf-8", "surrogateescape")
            for a, b in zip(starts, ends, strict=True)
        ]
        columns = (keys, sizes[index].tolist(), mtimes[index].tolist(), index.tolist())
        rows = map(make, zip(*columns, strict=True))
        while chunk := list(islice(rows, _ITEMS_PER_CHUNK)):
            yield chunk
