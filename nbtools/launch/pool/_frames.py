"""Frames: how one message is laid out on a pool link, and large buffers by shared memory.

A frame is one pickle (protocol 5) and its out-of-band buffers: a header of
two 8-byte big-endian numbers (the pickle's length, how many buffers), each
buffer's length (8 bytes each), the pickle, then the buffers (:func:`frame`).

Shared memory. A frame for local ranks whose out-of-band buffers are large (a pushed tensor)
does not stream them through every rank's socket: the kernel writes them once
into an anonymous memory file (``memfd_create``), and each rank maps that file
copy-on-write, reading the kernel's pages without a copy of its own; a rank
that changes a pushed tensor changes its private copy of the touched pages
only. The frame then carries a small descriptor (the kernel's pid, the file's
descriptor number, each buffer's offset and length) in place of the buffers;
the rank opens the file through ``/proc/<pid>/fd/<n>``, which only processes
of the same user may do.

Where a rank cannot open ``/proc/<pid>/fd/<n>`` (``/proc`` mounted with
``hidepid``, a kernel of another user, ptrace restrictions), it says so when it
connects (:func:`can_open_shared`, in its hello) and the kernel streams that
rank's buffers through its socket instead, straight from the kernel's tensor
memory in chunks (no copy on the kernel's side), into one mapping per buffer on
the rank's. ``NBTOOLS_POOL_SHARED_MEMORY=0`` asks for that path everywhere.

Nothing is left behind: the file has no name, the kernel closes its
descriptor once the call is over (:class:`SharedBuffers` is closed when the
frame is dropped), and the memory goes when the last rank unmaps it.
Ranks on other machines (TCP links) get the buffers through the socket as usual.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import weakref
from typing import Any

from nbtools._internal import settings
from nbtools.launch._results import out_of_band

__all__ = [
    "HEADER",
    "LENGTH",
    "Frame",
    "Parts",
    "frame",
    "memory",
    "SharedBuffers",
    "open_shared",
    "SHARED_AT_LEAST",
    "SHARED_FLAG",
    "SHARED_ENV",
    "can_open_shared",
]

HEADER = struct.Struct("!QQ")  # the pickle's length, the number of out-of-band buffers
LENGTH = struct.Struct("!Q")
# A small message without buffers is written in one piece.
_ONE_PIECE = 64 * 1024
# Received buffers at least this large are anonymous memory maps.
_MAP_AT_LEAST = 1 << 20

#: Frames whose out-of-band buffers add up to at least this many bytes share them in memory.
SHARED_AT_LEAST = 16 << 20
#: Set in a frame header's buffer count: the buffers come as a descriptor of shared memory.
SHARED_FLAG = 1 << 63
_ALIGN = 4096  # each buffer starts on a page of its own: rank-side writes copy only its pages
# Linux writes at most this many bytes per call.
_WRITE_MAX = 0x7FFFF000


class SharedBuffers:
    """Buffers written once into an anonymous memory file; :meth:`descriptor` tells ranks where."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self._fd = os.memfd_create("nbtools-push", os.MFD_CLOEXEC)
        self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            layout = []
            offset = 0
            for view in buffers:
                offset += -offset % _ALIGN
                layout.append((offset, view.nbytes))
                offset += view.nbytes
            os.ftruncate(self._fd, max(offset, 1))
            for (start, length), view in zip(layout, buffers, strict=True):
                view = view.cast("B")
                done = 0
                while done < length:
                    done += os.pwrite(self._fd, view[done : done + _WRITE_MAX], start + done)
        except BaseException:
            self.close()
            raise
        self._descriptor = pickle.dumps((os.getpid(), self._fd, offset, layout))

    def descriptor(self) -> bytes:
        """What a rank needs to map the buffers (see :func:`open_shared`)."""
        return self._descriptor

    def close(self) -> None:
        """Close the kernel's descriptor; ranks that mapped the file keep their mappings."""
        self._closer()


#: ``0`` in a rank's environment: large buffers come through the socket, never by shared memory.
SHARED_ENV = "NBTOOLS_POOL_SHARED_MEMORY"


def can_open_shared(pid: int) -> bool:
    """Whether this process may open the memory files of process ``pid`` (rank side).

    Opening ``/proc/<pid>/fd/<n>`` and listing ``/proc/<pid>/fd`` pass the same
    check (same user, ptrace access), so the listing answers for every file.
    """
    if settings.read(SHARED_ENV) is False:
        return False
    try:
        os.listdir(f"/proc/{int(pid)}/fd")
    except OSError:
        return False
    return True


def open_shared(descriptor: bytes) -> list[Any]:
    """The buffers a :class:`SharedBuffers` describes, mapped copy-on-write (rank side).

    Raises:
        OSError: the kernel's memory file cannot be opened (another user, or the kernel is gone).
    """
    pid, fd, size, layout = pickle.loads(descriptor)
    with open(f"/proc/{int(pid)}/fd/{int(fd)}", "rb") as src:
        memory = mmap.mmap(src.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
    view = memoryview(memory)
    return [view[start : start + length] for start, length in layout]


#: One frame, as the buffers that are written one after the other.
Frame = tuple[Any, ...]


class Parts(tuple):
    """A frame's parts, and the same frame with its buffers in shared memory, made on demand."""

    data: bytes
    buffers: list[memoryview]
    _shared: tuple[Any, ...] | None = None
    _memory: SharedBuffers | None = None

    def for_local_rank(self) -> tuple[Any, ...]:
        """The frame for a rank on this machine: large buffers by shared memory, written once."""
        if sum(view.nbytes for view in self.buffers) < SHARED_AT_LEAST:
            return self
        if self._shared is None:
            self._memory = SharedBuffers(self.buffers)  # closed when this frame is dropped
            descriptor = self._memory.descriptor()
            head = HEADER.pack(len(self.data), SHARED_FLAG | len(self.buffers))
            self._shared = (head + LENGTH.pack(len(descriptor)) + descriptor, self.data)
        return self._shared


def frame(message: Any) -> Frame:
    """``message`` as one frame: the header, its pickle, its large buffers (not copied)."""
    kept: list[pickle.PickleBuffer] = []
    data = pickle.dumps(message, protocol=5, buffer_callback=out_of_band(kept))
    buffers = [buffer.raw() for buffer in kept]
    head = HEADER.pack(len(data), len(buffers)) + b"".join(
        LENGTH.pack(view.nbytes) for view in buffers
    )
    if not buffers and len(data) < _ONE_PIECE:
        return (head + data,)  # one write for a small message: one system call, one packet
    parts = Parts((head, data, *buffers))
    parts.data, parts.buffers = data, buffers
    return parts


def memory(size: int) -> bytearray | mmap.mmap:
    """Writable memory for one received buffer: mapped when large (zeroed lazily, by the
    kernel, as the bytes arrive, instead of once more beforehand)."""
    return mmap.mmap(-1, size) if size >= _MAP_AT_LEAST else bytearray(size)
