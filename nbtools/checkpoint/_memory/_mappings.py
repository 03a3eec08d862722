"""Slot files mapped into memory: the maps kept from one snapshot to the next, the spare
file a rank's next snapshot goes into, and the sink that receives peers' replicas.

A snapshot is copied straight into its slot file: the tensors go into
a shared mapping of the file (one copy, no staging buffer, no write system call
per byte), so the copy that blocks training is the only copy. The slot files
of a rank rotate (the oldest becomes the next one); their mappings are kept,
keyed by the file (:class:`MappedFiles`), so a snapshot pays no page faults and
no new mapping. Space is reserved with ``posix_fallocate`` before a file is
mapped: a full filesystem is an ``OSError`` there, never a SIGBUS in the middle
of a copy.

The slot files themselves (names, headers, who may trust them) are ``_slots``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from nbtools.checkpoint._memory import _layout
from nbtools.checkpoint._memory._slots import (
    HEADER_BYTES,
    Slot,
    claim,
    own_prefix,
    publish,
    remove,
    replica_prefix,
    replicas,
)

__all__ = [
    "Mapped",
    "MappedFiles",
    "Spare",
    "crc_of",
    "file_key",
    "Incoming",
    "ReplicaSink",
    "publish_mapped",
]


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass
class Mapped:
    """One slot file mapped from its start through its tensor region.

    Attributes:
        fd: The file, open for reading and writing.
        ino: Its ``(device, inode)``, the key of the cache.
        mm: The shared mapping of ``HEADER_BYTES + data_len`` bytes.
        data_len: Bytes of the tensor region.
        body: The tensor region as a ``uint8`` tensor (what is sent to a peer).
    """

    fd: int
    ino: tuple[int, int]
    mm: mmap.mmap
    data_len: int
    body: torch.Tensor
    signature: tuple[Any, ...] | None = None
    dests: list[torch.Tensor] = field(default_factory=list)

    def destinations(self, layout: _layout.Layout) -> list[torch.Tensor]:
        """The tensors over this mapping that ``layout``'s tensors are copied into."""
        if self.signature != layout.signature:
            self.dests = _layout.destinations(self.mm, layout, HEADER_BYTES)
            self.signature = layout.signature
        return self.dests

    def close(self) -> None:
        """Unmap and close the file."""
        self.dests = []
        self.body = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def crc_of(mapped: Mapped, tail: bytes) -> int:
    """Checksum of a body: the mapped tensor region, then ``tail`` (the skeleton)."""
    with memoryview(mapped.mm) as view:
        region = view[HEADER_BYTES : HEADER_BYTES + mapped.data_len]
        try:
            crc = _layout.checksum(region)
        finally:
            region.release()
    return _layout.checksum(tail, crc)


class MappedFiles:
    """The mappings of one writer's slot files, at most ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._maps: dict[tuple[int, int], Mapped] = {}

    def open(self, fd: int, data_len: int) -> Mapped:
        """The mapping of the file open as ``fd`` (which it takes over), sized for a tensor
        region of ``data_len`` bytes: the cached one when the file and size are the same."""
        try:
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            length = HEADER_BYTES + data_len
            cached = self._maps.pop(key, None)
            if cached is not None and cached.data_len == data_len:
                with contextlib.suppress(OSError):
                    os.close(cached.fd)
                cached.fd = fd
                self._maps[key] = cached
                return cached
            if cached is not None:
                cached.close()
            os.ftruncate(fd, length)
            os.posix_fallocate(fd, 0, length)
            mm = mmap.mmap(
                fd, length, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            raise
        body = (
            torch.frombuffer(mm, dtype=torch.uint8, count=data_len, offset=HEADER_BYTES)
            if data_len
            else torch.empty(0, dtype=torch.uint8)
        )
        mapped = Mapped(fd, key, mm, data_len, body)
        self._maps[key] = mapped
        while len(self._maps) > self.limit:
            oldest = next(iter(self._maps))
            self._maps.pop(oldest).close()
        return mapped

    def prune(self, live: set[tuple[int, int]]) -> None:
        """Unmap the files that are not in ``live`` (removed ones hold no memory then)."""
        for key in [k for k in self._maps if k not in live]:
            self._maps.pop(key).close()

    def forget(self, mapped: Mapped) -> None:
        """Unmap a file whose write failed."""
        if self._maps.get(mapped.ino) is mapped:
            del self._maps[mapped.ino]
        mapped.close()

    def close(self) -> None:
        """Unmap every file."""
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()


def file_key(path: str) -> tuple[int, int] | None:
    """The cache key of the file at ``path`` (None when it is gone)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


class Spare:
    """A rank's next slot file, made and mapped ahead by the background thread while the
    rank holds fewer than two slots (its first snapshots), so that no snapshot waits for a
    new file's pages to be reserved and mapped. It keeps a temporary name until a snapshot
    is written into it (a restarted rank removes it like any half-written file)."""

    def __init__(self, files: MappedFiles, directory: str, rank: int) -> None:
        self.files, self.directory, self.rank = files, directory, rank
        self.path: str | None = None

    def make(self, data_len: int) -> None:
        """Make the file (for a tensor region of ``data_len`` bytes) unless there is one."""
        if self.path is not None:
            return
        try:
            tmp, fd = claim(self.directory, self.rank, own_prefix(self.rank), None)
        except OSError:
            return
        try:
            self.files.open(fd, data_len)
        except OSError:
            remove([tmp])
            return
        self.path = tmp

    def take(self) -> tuple[str, int] | None:
        """The file's path and a new descriptor, for the next snapshot; None if there is none."""
        path, self.path = self.path, None
        if path is None:
            return None
        try:
            return path, os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            remove([path])
            return None

    def discard(self) -> None:
        """Remove the file, if any."""
        taken = self.take()
        if taken is not None:
            os.close(taken[1])
            remove([taken[0]])


# --- replicas received from peers ------------------------------------------------


def publish_mapped(
    mapped: Mapped, tmp: str, directory: str, prefix: str, tail: bytes, head: dict[str, Any]
) -> str:
    """Write ``tail`` (the skeleton) after the mapped tensor region of the temporary slot
    ``tmp``, then :func:`publish` it with ``head`` (which names the job and world)."""
    end = HEADER_BYTES + mapped.data_len
    os.pwrite(mapped.fd, tail, end)
    os.ftruncate(mapped.fd, end + len(tail))
    head.update(size=mapped.data_len + len(tail), data_len=mapped.data_len)
    return publish(mapped.fd, tmp, directory, prefix, head)


class Incoming:
    """Where a holder receives a peer's snapshot: ``body`` (filled by the transfer);
    :meth:`done` once it arrived, or :meth:`drop` when it did not.

    Made by :meth:`ReplicaSink.receive`; one whose slot file could not be made or
    mapped receives into a buffer of its own and refuses at :meth:`done`.
    """

    def __init__(
        self,
        body: torch.Tensor,
        publish: Any = None,
        drop: Any = None,
        error: str | None = None,
    ) -> None:
        self.body = body
        self._publish = publish
        self._drop = drop
        self._error = error

    def done(self, tail: bytes, crc: int) -> None:
        """Keep the replica whose skeleton is ``tail`` and whose checksum is ``crc``."""
        if self._error is not None or self._publish is None:
            raise OSError(self._error)
        self._publish(tail, crc)

    def drop(self) -> None:
        """Forget a replica that did not arrive whole."""
        if self._drop is not None:
            self._drop()


@dataclass
class ReplicaSink:
    """The replicas a rank holds for its peers, received into its next replica files.

    Args:
        directory: The job's snapshot directory ("" when it cannot be trusted).
        key: The job's key, recorded in each slot.
        rank: The holder (this rank).
        world: The job's world size.
        files: The holder's mapped replica files.
        shares: ``owner -> (base, count)`` of the ranks whose tensors the owner's
            snapshots share (see ``_layout``).
    """

    directory: str
    key: str
    rank: int
    world: int
    files: MappedFiles
    shares: dict[int, tuple[int, int]] = field(default_factory=dict)

    def held(self, owners: list[int] | None = None) -> list[Slot]:
        """The trusted replicas this rank holds (of ``owners``; None: any), oldest first."""
        if not self.directory:
            return []
        found = replicas(self.directory, self.key, self.rank, self.world, owners)
        return sorted(found, key=lambda s: s.step)

    def receive(self, owner: int, step: int, data_len: int) -> Incoming:
        """Where the replica of ``owner``'s ``step`` is received: its next replica file
        (the newest complete one of ``owner`` stays while it is written)."""
        held = self.held([owner])
        older = [s for s in held if s.step != step][-1:]
        drop = [s for s in held if s not in older]
        reuse = drop.pop(0) if drop else None
        remove([s.path for s in drop])
        prefix = replica_prefix(owner, self.rank)
        try:
            tmp, fd = claim(self.directory, self.rank, prefix, reuse)
        except OSError as exc:
            return Incoming(torch.empty(data_len, dtype=torch.uint8), error=str(exc))
        try:
            mapped = self.files.open(fd, data_len)
        except OSError as exc:
            remove([tmp])
            return Incoming(torch.empty(data_len, dtype=torch.uint8), error=str(exc))

        def drop_it() -> None:
            self.files.forget(mapped)
            remove([tmp])

        def keep(tail: bytes, crc: int) -> None:
            try:
                if crc_of(mapped, tail) != crc:
                    raise ValueError("it arrived damaged (checksum)")
                head: dict[str, Any] = {"rank": owner, "step": step, "crc": crc}
                head["holder"] = self.rank
                head["share"] = list(self.shares.get(owner, (owner, 1)))
                head.update(job=self.key, world=self.world)
                publish_mapped(mapped, tmp, self.directory, prefix, tail, head)
            except BaseException:
                drop_it()
                raise

        return Incoming(mapped.body, keep, drop_it)

    def prune(self) -> None:
        """Unmap the replica files no longer held."""
        self.files.prune({k for s in self.held() if (k := file_key(s.path))})
