"""A read-only FUSE passthrough that adds latency to each open and read: a slow volume.

Run as ``python benchmarks/_slowfs.py SOURCE MOUNTPOINT --open-ms 20 --read-ms 1``;
it serves SOURCE at MOUNTPOINT in the foreground until unmounted
(``fusermount3 -u MOUNTPOINT``) or sent SIGTERM/SIGINT.

For tests: ``--shrink-at N --shrink-to M`` truncates a file on SOURCE to M bytes
the first time a read reaches offset N (a file that shrinks during a copy);
``--counts FILE`` appends one line per directory listed (``readdir``) to FILE;
``--attr-timeout S`` sets how long the kernel caches attributes (libfuse: 1 s).
"""

from __future__ import annotations

import argparse
import errno
import os
import time

import mfusepy

__all__ = ["SlowPassthrough", "main"]


class SlowPassthrough(mfusepy.Operations):
    """Serves ``source`` read-only; ``open`` and ``read`` sleep first, as a remote volume would."""

    use_ns = True

    def __init__(
        self,
        source: str,
        open_s: float,
        read_s: float,
        shrink: tuple[int, int] | None = None,
        counts: str | None = None,
    ) -> None:
        self.source = os.path.realpath(source)
        self.open_s = open_s
        self.read_s = read_s
        self.shrink = shrink
        self.counts = counts

    def _full(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._full(path))
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None
        keys = (
            "st_mode",
            "st_nlink",
            "st_size",
            "st_uid",
            "st_gid",
            "st_atime",
            "st_mtime",
            "st_ctime",
        )
        out = {k: getattr(st, k) for k in keys}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = getattr(st, k + "_ns")
        return out

    def readdir(self, path, fh):
        if self.counts:
            with open(self.counts, "a") as out:
                out.write(path + "\n")
        return [".", "..", *os.listdir(self._full(path))]

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        time.sleep(self.open_s)
        return os.open(self._full(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        time.sleep(self.read_s)
        if self.shrink is not None and offset + size >= self.shrink[0]:
            os.truncate(self._full(path), self.shrink[1])
            self.shrink = None
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        keys = (
            "f_bavail",
            "f_bfree",
            "f_blocks",
            "f_bsize",
            "f_favail",
            "f_ffree",
            "f_files",
            "f_flag",
            "f_frsize",
            "f_namemax",
        )
        return {k: getattr(st, k) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--open-ms", type=float, default=20.0)
    parser.add_argument("--read-ms", type=float, default=1.0)
    parser.add_argument("--shrink-at", type=int, default=None)
    parser.add_argument("--shrink-to", type=int, default=0)
    parser.add_argument("--counts", default=None)
    parser.add_argument("--attr-timeout", type=float, default=None)
    args = parser.parse_args()
    shrink = (args.shrink_at, args.shrink_to) if args.shrink_at is not None else None
    ops = SlowPassthrough(
        args.source, args.open_ms / 1000, args.read_ms / 1000, shrink, args.counts
    )
    extra = {} if args.attr_timeout is None else {"attr_timeout": args.attr_timeout}
    mfusepy.FUSE(ops, args.mountpoint, foreground=True, nothreads=False, ro=True, **extra)


if __name__ == "__main__":
    main()
