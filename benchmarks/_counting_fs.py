"""A read-only FUSE passthrough that counts the bytes it serves and can stop answering.

Run as ``python benchmarks/_counting_fs.py SOURCE MOUNTPOINT CONTROL``; it serves
SOURCE at MOUNTPOINT in the foreground until unmounted or sent SIGTERM. Files
are opened with direct I/O, so every read a process makes reaches this daemon
(the page cache would otherwise serve concurrent readers of one file once).
After each read the total served is written to ``CONTROL/served``. While the
file ``CONTROL/stall`` exists, reads of files whose names end with its content
(e.g. ``.distcp``) get no answer.
"""

from __future__ import annotations

import argparse
import errno
import os
import threading
import time

import mfusepy

__all__ = ["CountingPassthrough", "main"]


class CountingPassthrough(mfusepy.Operations):
    """Serves ``source`` read-only with direct I/O; counts bytes read; stalls on request."""

    use_ns = True

    def __init__(self, source: str, control: str) -> None:
        self.source = os.path.realpath(source)
        self.control = control
        self.served = 0
        self._mutex = threading.Lock()

    def _full(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._full(path))
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None
        out = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid")}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = getattr(st, k + "_ns")
        return out

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._full(path))]

    def open(self, path, fi):
        if fi.flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        fi.direct_io = True
        fi.fh = os.open(self._full(path), os.O_RDONLY)
        return 0

    def _stalled(self, path: str) -> bool:
        try:
            with open(os.path.join(self.control, "stall")) as fh:
                suffix = fh.read().strip()
        except FileNotFoundError:
            return False
        return path.endswith(suffix)

    def read(self, path, size, offset, fi):
        while self._stalled(path):
            time.sleep(0.2)
        data = os.pread(fi.fh, size, offset)
        with self._mutex:
            self.served += len(data)
            tmp = os.path.join(self.control, ".served")
            with open(tmp, "w") as fh:
                fh.write(str(self.served))
            os.replace(tmp, os.path.join(self.control, "served"))
        return data

    def release(self, path, fi):
        os.close(fi.fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        return {k: getattr(st, k) for k in (*keys, "f_flag", "f_frsize", "f_namemax")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("control")
    args = parser.parse_args()
    ops = CountingPassthrough(args.source, args.control)
    mfusepy.FUSE(ops, args.mountpoint, raw_fi=True, foreground=True, nothreads=False, ro=True)


if __name__ == "__main__":
    main()
