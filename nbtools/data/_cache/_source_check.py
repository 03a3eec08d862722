"""Whether a copy holds its source as listed: the size and modification time a copy is checked
against, before and after it is read.

A volume is shared storage: a file can be replaced or grow while a node copies it. A copy
counts only when it holds exactly the listed bytes of a source that did not change while it
was read; anything else is :class:`SourceChanged`, which the cache answers by copying again
(a few times) and then by an error naming the file.
"""

from __future__ import annotations

import os
from typing import IO

__all__ = ["SourceChanged", "check_copy", "source_stat"]


class SourceChanged(Exception):
    """A copy does not hold the source as listed: it changed before or while it was read."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(message)
        self.source = source


def source_stat(src: IO[bytes]) -> tuple[int, int] | None:
    """``(size, mtime_ns)`` of an open source, or None where it has no descriptor."""
    try:
        st = os.fstat(src.fileno())
    except (AttributeError, OSError, ValueError):
        return None  # e.g. an fsspec file: only the byte count is checked
    return st.st_size, st.st_mtime_ns


def check_copy(
    src: IO[bytes],
    key: str,
    size: int,
    mtime_ns: int,
    copied: int,
    before: tuple[int, int] | None,
    after: tuple[int, int] | None,
) -> None:
    """Raise :class:`SourceChanged` unless ``copied`` bytes are the whole, unchanged source."""
    name = getattr(src, "name", None) or getattr(src, "path", None)
    source = name if isinstance(name, str) else key
    if copied > size:
        raise SourceChanged(source, f"listed {size} bytes, it holds more now")
    if copied != size:
        raise SourceChanged(source, f"listed {size} bytes, read {copied}")
    if after is None:
        return
    if before != after:
        was = before[0] if before else "?"
        raise SourceChanged(source, f"{was} bytes when opened, {after[0]} after the copy")
    if after[0] != size or (mtime_ns and after[1] != mtime_ns):
        raise SourceChanged(
            source,
            f"listed {size} bytes, mtime {mtime_ns} ns; now {after[0]} bytes, mtime {after[1]} ns",
        )
