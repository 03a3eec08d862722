"""A read-only FUSE passthrough that adds latency to each open and read: a slow volume.

Run as ``python benchmarks/_slowfs.py SOURCE MOUNTPOINT --open-ms 20 --read-ms 1``;
it serves SOURCE at MOUNTPOINT in the foreground until unmounted
(``fusermount3 -u MOUNTPOINT``) or sent SIGTERM/SIGINT.
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

    def __init__(self, source: str, open_s: float, read_s: float) -> None:
        self.source = os.path.realpath(source)
        self.open_s = open_s
        self.read_s = read_s

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
        return [".", "..", *os.listdir(self._full(path))]

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        time.sleep(self.open_s)
        return os.open(self._full(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        time.sleep(self.read_s)
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
    args = parser.parse_args()
    ops = SlowPassthrough(args.source, args.open_ms / 1000, args.read_ms / 1000)
    mfusepy.FUSE(ops, args.mountpoint, foreground=True, nothreads=False, ro=True)


if __name__ == "__main__":
    main()
