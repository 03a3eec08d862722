"""Snapshot files in a job's directory: their names, headers, maps, and who may trust them.

In a job's directory (see ``_directories``) each rank keeps at most two complete
snapshots, ``r<rank>-<random>.slot`` (mode 0600): its newest and the one
before, so a rank killed while it writes a snapshot (the third file, under a
temporary name) leaves the previous ones whole, and every rank still holds the
step before. A rank that holds a peer's replicas keeps at most two of each,
``x<owner>-h<holder>-<random>.slot``, received through its
``ReplicaSink`` (``_mappings``). Files being written are ``.tmp-r<writer>-...``: a
restarted rank removes what it left half-written.

A slot opens with a fixed-size header (JSON: job, rank, world size, step,
payload size and CRC-32C, the size of its tensor region, for a replica the rank
holding it, and the CRC-32C of all these fields), then the payload. A slot is
used only when it is a regular file of this user with mode 0600, in a directory
of this user that nobody else can write, and its header (checksum included),
size and payload checksum agree; a restore also checks that the snapshot holds
the step its header claims. Anything else is skipped with one warning, like a
corrupt checkpoint.

The memory maps of slot files, kept from one snapshot to the next, and the sink
that receives peers' replicas are in ``_mappings``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

from nbtools._internal.log import get_logger
from nbtools.checkpoint._memory import _layout, _notes
from nbtools.errors import CheckpointError

#: Bytes read and checksummed at a time when a slot is read back (stays in the cache).
_READ_CHUNK = 4 << 20

__all__ = [
    "Slot",
    "write_slot",
    "own_prefix",
    "replica_prefix",
    "claim",
    "publish",
    "read_slot",
    "map_slot",
    "map_peer",
    "verify",
    "new_buffer",
    "slots",
    "replicas",
    "visible",
    "remove",
    "remove_rank",
    "sweep_temporaries",
    "tensor_of",
]

_log = get_logger("checkpoint")

_MAGIC = b"NBTSNAP3"  # 2: CRC-32C checksums; 3: the header checksummed too
#: Bytes before the payload: the magic, then the JSON header padded with spaces.
HEADER_BYTES = 4096
#: ``holder`` of :func:`visible`: a slot of any rank, its owner's own or a replica.
ANY = -1
_TMP = ".tmp-"


@dataclass(frozen=True)
class Slot:
    """One complete snapshot file of a rank, as its header describes it."""

    path: str
    rank: int
    world: int
    step: int
    size: int
    crc: int
    #: Bytes of the tensor region at the payload's start (see ``_layout``).
    data_len: int = 0
    #: The rank holding this slot for its owner ``rank``; None for the owner's own.
    holder: int | None = None
    #: ``(base, count)``: the ranks whose slots of this step hold the replicated tensors
    #: this slot lacks (see ``_layout``); ``(rank, 1)`` for a slot that holds them all.
    share: tuple[int, int] | None = None


class _Crc:
    """A write-only file wrapper that keeps the checksum and count of what passes through."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.crc, self.size = fh, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = _layout.checksum(view, self.crc)
        self.size += len(view)
        return self.fh.write(view)

    def flush(self) -> None:
        self.fh.flush()


def _open_temporary(tmp: str, reuse: Slot | None, mode: int = os.O_WRONLY) -> int:
    """A descriptor for writing ``tmp``: ``reuse``'s file renamed to it when that works
    (its memory pages are overwritten, cheaper on tmpfs than a new file's), else a new file."""
    if reuse is not None:
        try:
            os.rename(reuse.path, tmp)  # from here it is no slot: nobody loads it
        except OSError:
            pass
        else:
            try:
                return os.open(tmp, mode | os.O_NOFOLLOW)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    return os.open(tmp, mode | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def write_slot(
    directory: str,
    key: str,
    rank: int,
    world: int,
    step: int,
    dump: Any,
    reuse: Slot | None = None,
) -> Slot:
    """Write a snapshot through ``dump(file)`` under a temporary name, then publish it.

    Nothing half-written is ever a slot: the file gets its final (random) name
    only after its header with the checksum is in place. On any error the
    temporary file is removed and the error raised. ``reuse``, a slot of this
    rank that is no longer wanted, gives up its file to the new snapshot.
    """
    tmp = os.path.join(directory, f"{_TMP}r{rank}-{secrets.token_hex(8)}")
    fd = _open_temporary(tmp, reuse)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"\0" * HEADER_BYTES)
            body = _Crc(fh)
            dump(body)
            fh.truncate(HEADER_BYTES + body.size)  # a reused file may have been longer
            head = {"job": key, "rank": rank, "world": world, "step": step}
            head.update(size=body.size, crc=body.crc)
            data = _sealed(head)
            fh.seek(0)
            fh.write(data)
        final = os.path.join(directory, f"r{rank}-{secrets.token_hex(16)}.slot")
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return Slot(final, rank, world, step, body.size, body.crc)


def own_prefix(rank: int) -> str:
    """The name prefix of ``rank``'s own slots."""
    return f"r{rank}"


def replica_prefix(owner: int, holder: int) -> str:
    """The name prefix of ``owner``'s replicas that ``holder`` keeps."""
    return f"x{owner}-h{holder}"


def claim(directory: str, writer: int, prefix: str, reuse: Slot | None) -> tuple[str, int]:
    """A temporary file for ``writer``'s next slot named ``prefix``, open for reading and
    writing: ``reuse``'s file when that works, else a new one. Its path and descriptor."""
    tmp = os.path.join(directory, f"{_TMP}r{writer}-{prefix}-{secrets.token_hex(8)}")
    fd = _open_temporary(tmp, reuse, os.O_RDWR)
    return tmp, fd


def publish(fd: int, tmp: str, directory: str, prefix: str, head: dict[str, Any]) -> str:
    """Write ``head`` at the start of the temporary file ``tmp`` and give it its slot name.

    The file's payload must be complete: from here it is a slot. Returns its path.
    """
    os.pwrite(fd, _sealed(head), 0)
    final = os.path.join(directory, f"{prefix}-{secrets.token_hex(16)}.slot")
    os.rename(tmp, final)
    return final


def _head_crc(head: dict[str, Any]) -> int:
    fields = {k: v for k, v in head.items() if k != "head_crc"}
    return _layout.checksum(json.dumps(fields, sort_keys=True).encode())


def _sealed(head: dict[str, Any]) -> bytes:
    """The header block of ``head``: the magic, then the record with a checksum of its own
    fields (``head_crc``), padded to :data:`HEADER_BYTES`."""
    data = _MAGIC + json.dumps({**head, "head_crc": _head_crc(head)}).encode()
    if len(data) > HEADER_BYTES:
        raise CheckpointError("snapshot header too long (a job key of over 3 KB)")
    return data.ljust(HEADER_BYTES, b" ")


def _header(fh: IO[bytes]) -> dict[str, Any]:
    data = fh.read(HEADER_BYTES)
    if len(data) != HEADER_BYTES or not data.startswith(_MAGIC):
        raise ValueError("no snapshot header of this version")
    head = json.loads(data[len(_MAGIC) :].decode())
    if not isinstance(head, dict):
        raise ValueError("a header that is not a record")
    if head.get("head_crc") != _head_crc(head):
        raise ValueError("the header does not match its checksum")
    return head


def _scan(
    directory: str, key: str, world: int, prefix: str, owner: int, holder: int | None
) -> Iterator[Slot]:
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    for name in names:
        if not (name.startswith(f"{prefix}-") and name.endswith(".slot")):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:  # rotated away since it was listed (see claim)
            continue
        except OSError as exc:
            _notes.once(f"skip|{path}", "skipping snapshot %s: cannot open it (%s)", path, exc)
            continue
        with os.fdopen(fd, "rb") as fh:
            slot, why = _trusted(fh, path, key, world, owner, holder)
        if slot is None:
            _notes.once(f"skip|{path}", "skipping snapshot %s: %s", path, why)
            continue
        yield slot


def _share(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    base, count = (int(v) for v in value)
    return base, count


def _trusted(
    fh: IO[bytes], path: str, key: str, world: int, owner: int, holder: int | None
) -> tuple[Slot | None, str]:
    """The slot open as ``fh`` when its file and header can be trusted, else why not."""
    info = os.fstat(fh.fileno())
    if not stat.S_ISREG(info.st_mode):
        return None, "not a regular file"
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return None, f"owned by uid {info.st_uid} with mode {info.st_mode & 0o777:o}, not 600"
    try:
        head = _header(fh)
        slot = Slot(
            path,
            int(head["rank"]),
            int(head["world"]),
            int(head["step"]),
            int(head["size"]),
            int(head["crc"]),
            int(head.get("data_len", 0)),
            None if head.get("holder") is None else int(head["holder"]),
            _share(head.get("share")),
        )
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"a damaged header ({exc})"
    if head.get("job") != key or slot.rank != owner or slot.world != world:
        return None, "a snapshot of another job, rank or world size"
    if slot.share is not None and not 0 <= slot.share[0] <= owner < sum(slot.share) <= world:
        return None, f"a share of ranks {slot.share} that does not hold rank {owner}"
    if holder != ANY and slot.holder != holder:
        return None, f"held for rank {slot.holder}, not {holder}"
    if info.st_size != HEADER_BYTES + slot.size or not 0 <= slot.data_len <= slot.size:
        return None, f"{info.st_size} bytes where its header says {HEADER_BYTES + slot.size}"
    return slot, ""


def slots(directory: str, key: str, rank: int, world: int) -> Iterator[Slot]:
    """The complete snapshots of ``rank`` in ``directory`` whose file and header can be
    trusted (the checksum is checked on :func:`read_slot`); others are skipped with a warning."""
    return _scan(directory, key, world, own_prefix(rank), rank, None)


def replicas(
    directory: str, key: str, holder: int, world: int, owners: list[int] | None = None
) -> Iterator[Slot]:
    """The trusted replicas ``holder`` keeps in ``directory``, of ``owners`` (None: all)."""
    for owner in range(world) if owners is None else owners:
        if owner != holder:
            yield from _scan(directory, key, world, replica_prefix(owner, holder), owner, holder)


def visible(directory: str, key: str, owner: int, world: int) -> Iterator[Slot]:
    """Every trusted slot of ``owner`` in ``directory``: its own, then the replicas of it
    that any rank keeps (a restarted rank may sit on another node than before: whoever
    is on the node that holds a slot can serve it)."""
    yield from _scan(directory, key, world, own_prefix(owner), owner, None)
    yield from _scan(directory, key, world, f"x{owner}", owner, ANY)


def read_slot(slot: Slot) -> Any:
    """The payload of ``slot`` (a writable buffer of its own), checked against its checksum.

    The file is read in chunks into an anonymous mapping (no zero-filled buffer to
    write over) and each chunk is checksummed while it is still in the cache: the
    bytes cross memory once.

    Raises:
        CheckpointError: The file changed or its bytes do not match the checksum.
    """
    data = new_buffer(slot.size)
    got, crc = 0, 0
    fd = os.open(slot.path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb", buffering=0) as fh, memoryview(data) as view:
        fh.seek(HEADER_BYTES)
        while got < slot.size:
            n = fh.readinto(view[got : got + _READ_CHUNK]) or 0
            if not n:
                break
            crc = _layout.checksum(view[got : got + n], crc)
            got += n
        extra = fh.read(1)
    if got != slot.size or extra or crc != slot.crc:
        raise CheckpointError(
            f"snapshot {slot.path} of step {slot.step} does not match its checksum "
            f"({got} of {slot.size} bytes); it is not used"
        )
    return data


def map_slot(slot: Slot) -> mmap.mmap:
    """``slot``'s whole file mapped shared and writable, its payload checked against its
    checksum: the restore of a rank's own slot, which hands the mapped pages to the
    objects restored instead of copying them (see ``_in_place``).

    The payload starts at :data:`HEADER_BYTES` in the mapping. The pages are the
    file's own (shared memory): mapping them costs no copy and no zero-filling.

    Raises:
        CheckpointError: The file changed or its bytes do not match the checksum.
    """
    mm, _ = _map(slot, writable=True)
    try:
        verify(mm, slot)
    except CheckpointError:
        mm.close()
        raise
    return mm


def map_peer(slot: Slot) -> tuple[mmap.mmap, tuple[int, int]]:
    """``slot``'s whole file mapped read-only, not yet checked (see :func:`verify`), and the
    file's ``(device, inode)``: a slot of another rank of this node whose tensors are
    copied out (another rank's file is never written here)."""
    return _map(slot, writable=False)


def _map(slot: Slot, writable: bool) -> tuple[mmap.mmap, tuple[int, int]]:
    fd = os.open(slot.path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        length = HEADER_BYTES + slot.size
        if info.st_size != length or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise CheckpointError(
                f"snapshot {slot.path} of step {slot.step} changed since it was listed "
                f"({info.st_size} bytes where its header says {length}); it is not used"
            )
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, length, flags=flags, prot=prot)
    finally:
        os.close(fd)
    return mm, (info.st_dev, info.st_ino)


def verify(mm: mmap.mmap, slot: Slot) -> None:
    """Check the payload ``mm`` maps (a whole slot file) against ``slot``'s checksum.

    Raises:
        CheckpointError: The bytes do not match.
    """
    crc = 0
    with memoryview(mm) as view:
        for start in range(HEADER_BYTES, len(mm), _READ_CHUNK):
            with view[start : min(len(mm), start + _READ_CHUNK)] as chunk:
                crc = _layout.checksum(chunk, crc)
    if crc != slot.crc:
        raise CheckpointError(
            f"snapshot {slot.path} of step {slot.step} does not match its checksum; it is not used"
        )


def new_buffer(size: int) -> Any:
    """A writable buffer of ``size`` bytes that no one else maps: an anonymous mapping,
    its pages faulted in at once by the kernel (no zero-filling pass here, no fault per
    page while it is filled)."""
    if not size:
        return bytearray()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


def remove(paths: list[str]) -> None:
    """Delete snapshot files (absent ones are fine)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def remove_rank(directory: str, rank: int) -> None:
    """Remove every slot file of ``rank`` in ``directory``, its own and the replicas it
    holds, trusted or not (a damaged one too): what a clean close leaves is nothing.
    Only this user's regular files go (links are not followed)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if not name.endswith(".slot"):
                continue
            mine = name.startswith(f"{own_prefix(rank)}-")
            held = name.startswith("x") and f"-h{rank}-" in name
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(path)
                if (mine or held) and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    os.unlink(path)


def sweep_temporaries(directory: str, rank: int) -> None:
    """Remove what a killed writer of ``rank`` left half-written in ``directory``."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(f"{_TMP}r{rank}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))


def tensor_of(data: Any) -> torch.Tensor:
    """A ``uint8`` tensor over a writable buffer (empty for an empty one)."""
    return (
        torch.frombuffer(data, dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )
