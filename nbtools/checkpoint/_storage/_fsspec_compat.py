"""The fsspec boundary: the one private fsspec name the storage half uses.

A ranged read of an async filesystem (s3fs, gcsfs, adlfs) goes through the
coroutine ``AsyncFileSystem._cat_file`` run on the filesystem's own loop by
``fsspec.asyn.sync``, because only that call takes a ``timeout`` that cancels
the request itself; the public ``cat_file`` waits for as long as the store
does. Each private name used here has a test in
``tests/checkpoint/storage/test_fsspec_compat.py`` that fails when fsspec drops it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cat_range"]


def cat_range(fs: Any, path: str, start: int, end: int, timeout: float) -> bytes:
    """Bytes ``[start, end)`` of ``path`` on ``fs``; a request still running after
    ``timeout`` seconds is cancelled with ``TimeoutError`` (async filesystems only).

    Synchronous filesystems read with the public ``cat_file``; their reads are
    watched for stalls by the caller instead.
    """
    if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
        from fsspec.asyn import sync

        try:
            return sync(fs.loop, fs._cat_file, path, start=start, end=end, timeout=timeout)
        except Exception as exc:
            if type(exc).__name__ == "FSTimeoutError":
                raise TimeoutError(str(exc) or "request timed out") from exc
            raise
    return fs.cat_file(path, start=start, end=end)
