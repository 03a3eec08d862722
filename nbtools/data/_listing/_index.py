"""The index of a dataset: one compact, memory-mapped file of paths, sizes and mtimes.

Layout (native byte order, every section 8-byte aligned)::

    b"NBTIDX01" | header length (u64) | header CRC-32 (u64) | header (JSON) | sections

The sections are ``offsets`` (int64, n + 1: where each path starts in ``paths``),
``sizes`` and ``mtimes`` (int64, n), ``paths`` (the relative paths, ``/``-separated,
file-system encoded, back to back), and the same three for the directories the
listing entered (``dir_offsets``, ``dir_mtimes``, ``dir_paths``), which the
freshness check stats. The header names each section's place, length and
CRC-32, the pattern the index lists and the root it was listed at (for messages:
the paths are relative, so the index serves the same volume mounted at another
path), the number of files, the largest size, a fingerprint of the paths and
when and by which job it was built.

Every process maps the file read-only: the pages are the page cache's, shared by
every rank and loader worker on the node, and no process holds a Python object
per file. An index is written to a temporary name and moved into place with
``os.replace``, so a reader sees a complete file or none.

An index is used only when it passes :func:`open_index`'s checks: owned by this
user and writable by nobody else, the expected pattern and version,
sections inside the file and matching their CRCs, offsets in order, and every
path a plain relative path below the root (no empty, hidden, ``.`` or ``..``
component, no leading ``/``). The checks that read every byte (CRCs, paths)
are skipped for a file whose identity (device, inode, size, mtime, ctime) the
caller knows to have passed them already (see ``_catalog``): replaced or
modified, a file has another identity and is read in full again.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import mmap
import os
import stat
import struct
import zlib
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from nbtools._internal.fs import TMP_PREFIX

__all__ = ["Index", "IndexRefused", "IndexWriter", "identity", "open_index", "FORMAT"]

FORMAT = 1
_MAGIC = b"NBTIDX01"
_PREAMBLE = struct.Struct("<8sQQ")
_SPILL = 1 << 16  # entries buffered before they go to the spill files
_CHECK_BLOCK = 1 << 22  # bytes of paths checked at a time (bounds the temporary arrays)
_DOT, _SLASH = ord("."), ord("/")
_SECTIONS = ("offsets", "sizes", "mtimes", "paths", "dir_offsets", "dir_mtimes", "dir_paths")


class IndexRefused(Exception):
    """An index file that must not be used; the message says why."""


def _pad(n: int) -> int:
    return -n % 8


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _Spill:
    """One section written as it grows, with its CRC, in a temporary file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh = open(path, "w+b")  # closed by IndexWriter
        self.crc = 0
        self.length = 0

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.length += len(data)


class IndexWriter:
    """Builds an index file from entries given in path order, in bounded memory.

    Args:
        path: Final path of the index file.
        root: The root the paths are relative to.
        pattern: The pattern the listing matched.
        extra: More header fields (job, listing time, whether it can be checked).
    """

    def __init__(self, path: str, root: str, pattern: str, extra: dict[str, Any]) -> None:
        self.path = path
        self.header: dict[str, Any] = {
            "format": FORMAT,
            "root": root,
            "pattern": pattern,
            **extra,
        }
        # Temporary names a later sweep of the cache removes if this process dies.
        base = os.path.join(
            os.path.dirname(path), f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        )
        self._spills = {name: _Spill(f"{base}.{name}") for name in _SECTIONS}
        self._buffers = {name: array("q") for name in ("offsets", "sizes", "mtimes")}
        self._buffers["offsets"].append(0)
        self._dirs: list[tuple[bytes, int]] = []
        self._hash = hashlib.sha1()
        self._blob = bytearray()
        self._end = 0
        self.count = 0
        self.largest = 0
        self._utf8 = True

    def add_files(self, rels: list[bytes], sizes: list[int], mtimes: list[int]) -> None:
        """Files in path order, ``rels`` their file-system encoded paths relative to the root."""
        if not rels:
            return
        joined = b"".join(rels)
        if self._utf8 and not joined.isascii():
            self._utf8 = _is_utf8(joined)
        self._blob += joined
        self._hash.update(b"\0".join(rels) + b"\0")
        offsets = list(accumulate(map(len, rels), initial=self._end))
        self._end = offsets[-1]
        self._buffers["offsets"].extend(offsets[1:])
        self._buffers["sizes"].extend(sizes)
        self._buffers["mtimes"].extend(mtimes)
        self.count += len(rels)
        self.largest = max(self.largest, max(sizes))
        if len(self._buffers["sizes"]) >= _SPILL:
            self._flush()

    def add_file(self, rel: bytes, size: int, mtime_ns: int) -> None:
        """One file (see :meth:`add_files`)."""
        self.add_files([rel], [size], [mtime_ns])

    def add_dir(self, rel: bytes, mtime_ns: int) -> None:
        """One directory the listing entered (``b""`` for the root) and its mtime then."""
        self._dirs.append((rel, mtime_ns))

    @property
    def nbytes(self) -> int:
        """About how many bytes the index holds so far (spilled, buffered and its directories)."""
        spilled = sum(spill.length for spill in self._spills.values())
        buffered = sum(len(values) * 8 for values in self._buffers.values()) + len(self._blob)
        dirs = sum(len(rel) + 16 for rel, _ in self._dirs)
        return spilled + buffered + dirs + 4096  # and a header

    @property
    def fingerprint(self) -> str:
        """A digest of the paths, to recognise the same list of files."""
        return self._hash.hexdigest()[:16]

    def _flush(self) -> None:
        for name, values in self._buffers.items():
            self._spills[name].write(memoryview(values).cast("B"))
            del values[:]
        self._spills["paths"].write(bytes(self._blob))
        self._blob.clear()

    def commit(self) -> str:
        """Write the file under a temporary name, fsync it, move it into place; its path."""
        self._flush()
        dir_offsets, dir_mtimes, dir_blob = array("q", [0]), array("q"), bytearray()
        for rel, mtime in self._dirs:
            dir_blob += rel
            dir_offsets.append(len(dir_blob))
            dir_mtimes.append(mtime)
        self._spills["dir_offsets"].write(memoryview(dir_offsets).cast("B"))
        self._spills["dir_mtimes"].write(memoryview(dir_mtimes).cast("B"))
        self._spills["dir_paths"].write(bytes(dir_blob))
        header = dict(
            self.header,
            count=self.count,
            dirs=len(self._dirs),
            largest=self.largest,
            fingerprint=self.fingerprint,
            utf8=self._utf8,
        )
        # Place the sections after a header whose own length depends on them.
        for _ in range(3):
            start = _PREAMBLE.size + len(json.dumps(header).encode()) + 8
            start += _pad(start)
            places = {}
            for name in _SECTIONS:
                spill = self._spills[name]
                places[name] = [start, spill.length, spill.crc]
                start += spill.length + _pad(spill.length)
            header["sections"] = places
        text = json.dumps(header).encode()
        tmp = os.path.join(
            os.path.dirname(self.path), f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}.idx"
        )
        try:
            with open(tmp, "wb") as out:
                out.write(_PREAMBLE.pack(_MAGIC, len(text), zlib.crc32(text)))
                out.write(text)
                for name in _SECTIONS:
                    begin = places[name][0]
                    out.write(b"\0" * (begin - out.tell()))
                    fh = self._spills[name].fh
                    fh.seek(0)
                    while chunk := fh.read(1 << 20):
                        out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            self.discard()
        return self.path

    def discard(self) -> None:
        """Remove the spill files (also after a failed or interrupted build)."""
        for spill in self._spills.values():
            spill.fh.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spill.path)


@dataclass
class Index:
    """A validated, memory-mapped index (see the module docstring).

    ``offsets``, ``sizes`` and ``mtimes`` are memoryviews of int64 (indexing
    them gives Python ints); the bytes of path ``i`` are
    ``map[paths_start + offsets[i] : paths_start + offsets[i + 1]]``.
    """

    identity: list[int]
    path: str
    root: str
    header: dict[str, Any]
    offsets: memoryview
    sizes: memoryview
    mtimes: memoryview
    map: mmap.mmap
    paths_start: int
    dir_offsets: memoryview
    dir_mtimes: memoryview
    dir_paths: memoryview

    def __len__(self) -> int:
        return int(self.header["count"])

    @property
    def fingerprint(self) -> str:
        """The digest of the paths (the same as for a listing of the same files)."""
        return str(self.header["fingerprint"])

    @property
    def largest(self) -> int:
        """The largest file size in bytes (0 for no file)."""
        return int(self.header["largest"])

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``offsets``, ``sizes`` and ``mtimes`` as read-only int64 arrays over the map."""
        return tuple(  # type: ignore[return-value]
            np.frombuffer(view, dtype=np.int64) for view in (self.offsets, self.sizes, self.mtimes)
        )

    def relpath(self, i: int) -> str:
        """The ``/``-separated path of file ``i`` relative to the root."""
        base = self.paths_start
        return os.fsdecode(self.map[base + self.offsets[i] : base + self.offsets[i + 1]])

    def source(self, i: int) -> str:
        """The path or URL of file ``i`` on the volume."""
        return f"{self.root}/{self.relpath(i)}"

    def _path_bytes(self, i: int) -> bytes:
        base = self.paths_start
        return self.map[base + self.offsets[i] : base + self.offsets[i + 1]]

    def files_in(self, rel: str) -> list[tuple[bytes, int, int]] | None:
        """``(name, size, mtime_ns)`` of the files listed directly in directory ``rel``.

        A binary search over the sorted paths, skipping each subdirectory's
        files with another: the cost grows with the directory, not the tree.
        None for an index whose paths are not all UTF-8 (their byte order may
        then differ from the listing's order, so no search is trusted).
        """
        if not self.header.get("utf8"):
            return None
        paths = _Paths(self)
        prefix = os.fsencode(rel) + b"/" if rel else b""
        i, n, out = bisect.bisect_left(paths, prefix), len(self), []
        while i < n:
            path = paths[i]
            if not path.startswith(prefix):
                break
            rest = path[len(prefix) :]
            slash = rest.find(b"/")
            if slash < 0:
                out.append((rest, self.sizes[i], self.mtimes[i]))
                i += 1
            else:  # "0" follows "/": the first path after this subdirectory's
                i = bisect.bisect_left(paths, prefix + rest[:slash] + b"0", i)
        return out

    def directories(self):
        """``(relative path, mtime_ns when listed)`` of every directory entered."""
        offs, blob = self.dir_offsets, self.dir_paths
        for i in range(len(self.dir_mtimes)):
            yield os.fsdecode(bytes(blob[offs[i] : offs[i + 1]])), self.dir_mtimes[i]


class _Paths:
    """The paths of an index as a sequence of bytes, for :mod:`bisect`."""

    def __init__(self, index: Index) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> bytes:
        return self._index._path_bytes(i)


def _section(mm: mmap.mmap, header: dict[str, Any], name: str, size: int, deep: bool) -> memoryview:
    try:
        start, length, crc = (int(v) for v in header["sections"][name])
    except (KeyError, TypeError, ValueError):
        raise IndexRefused(f"its header has no valid place for {name!r}") from None
    aligned = name in ("paths", "dir_paths") or length % 8 == 0
    if start < 0 or length < 0 or start + length > size or not aligned:
        raise IndexRefused(f"section {name!r} lies outside the file or is misaligned")
    view = memoryview(mm)[start : start + length]
    if deep and zlib.crc32(view) != crc:
        raise IndexRefused(f"section {name!r} does not match its checksum (a damaged file)")
    return view


def _check_paths(offsets: np.ndarray, mm: mmap.mmap, start: int, length: int, what: str) -> None:
    """Every path non-empty, relative, below the root: no hidden, ``.`` or ``..`` part.

    Reads the map in place: no copy of the paths is made.
    """
    if len(offsets) and (offsets[0] != 0 or offsets[-1] != length):
        raise IndexRefused(f"the {what} offsets do not cover the paths")
    if (np.diff(offsets) <= 0).any():
        raise IndexRefused(f"the {what} list holds an empty path or offsets out of order")
    if not length:
        return
    data = np.frombuffer(mm, dtype=np.uint8, count=length, offset=start)
    firsts, lasts = data[offsets[:-1]], data[offsets[1:] - 1]
    bad = bool(((firsts == _DOT) | (firsts == _SLASH) | (lasts == _SLASH)).any())
    # No "/." or "//" inside a path and no NUL byte: a block at a time, each
    # block one byte longer than its step so that pairs across steps are seen.
    for begin in range(0, length, _CHECK_BLOCK):
        if bad:
            break
        block = data[begin : begin + _CHECK_BLOCK + 1]
        after = block[1:]
        pairs = (block[:-1] == _SLASH) & ((after == _DOT) | (after == _SLASH))
        bad = bool(pairs.any()) or not block.all()
    del data, firsts, lasts
    if bad:
        raise IndexRefused(f"the {what} list holds a path outside the root or a hidden one")


def identity(st: os.stat_result) -> list[int]:
    """What identifies one version of a file: replaced or modified, it changes."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def open_index(path: str, root: str, pattern: str, checked: list[int] | None = None) -> Index:
    """Map and check the index at ``path`` for ``pattern``, its files read under ``root``.

    ``checked``: the :func:`identity` of a file of this user's whose every
    byte an earlier open already checked. When the file opened has it, the
    checksums of the sections and the paths are not read again (the header,
    owner, format, root, pattern and section bounds still are), so opening it
    costs no time per file.

    Raises:
        FileNotFoundError: there is no index there.
        IndexRefused: it fails a check; the message says which.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IndexRefused("it is not a regular file")
        if st.st_uid != os.getuid():
            raise IndexRefused(f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise IndexRefused(f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})")
        if st.st_size < _PREAMBLE.size:
            raise IndexRefused("it is truncated")
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        magic, length, crc = _PREAMBLE.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise IndexRefused("it is not an nbtools index of this version")
        text = mm[_PREAMBLE.size : _PREAMBLE.size + length]
        if len(text) != length or zlib.crc32(text) != crc:
            raise IndexRefused("its header is damaged")
        try:
            header = json.loads(text)
        except ValueError:
            raise IndexRefused("its header is damaged") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise IndexRefused(f"it has format {header.get('format')!r}, not {FORMAT}")
        # The root it was listed at is not compared: the paths are relative, and the
        # same volume may be mounted elsewhere on another node or in a later job.
        if header.get("pattern") != pattern:
            raise IndexRefused(
                f"it lists the files matching {header.get('pattern')!r}, not {pattern!r}"
            )
        deep = checked is None or identity(st) != checked
        views = {name: _section(mm, header, name, st.st_size, deep) for name in _SECTIONS}
        count, dirs = int(header.get("count", -1)), int(header.get("dirs", -1))
        ints = {n: views[n].cast("q") for n in _SECTIONS if "paths" not in n}
        if (len(ints["offsets"]), len(ints["sizes"]), len(ints["mtimes"])) != (
            count + 1,
            count,
            count,
        ) or (len(ints["dir_offsets"]), len(ints["dir_mtimes"])) != (dirs + 1, dirs):
            raise IndexRefused("its sections do not hold as many entries as its header says")
        start, length = (int(v) for v in header["sections"]["paths"][:2])
        if deep:
            offsets = np.frombuffer(ints["offsets"], dtype=np.int64)
            _check_paths(offsets, mm, start, length, "file")
        dir_offsets = np.frombuffer(ints["dir_offsets"], dtype=np.int64)
        if dirs and dir_offsets[1] != 0:
            raise IndexRefused("its first directory is not the root")
        if dirs > 1 and deep:
            dstart, dlength = (int(v) for v in header["sections"]["dir_paths"][:2])
            _check_paths(dir_offsets[1:], mm, dstart, dlength, "directory")
        return Index(
            identity=identity(st),
            path=path,
            root=root,
            header=header,
            offsets=ints["offsets"],
            sizes=ints["sizes"],
            mtimes=ints["mtimes"],
            map=mm,
            paths_start=start,
            dir_offsets=ints["dir_offsets"],
            dir_mtimes=ints["dir_mtimes"],
            dir_paths=views["dir_paths"],
        )
    except IndexRefused:
        _close_quietly(mm)
        raise
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        _close_quietly(mm)
        raise IndexRefused(f"its header is inconsistent ({exc})") from None


def _close_quietly(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):
        mm.close()
