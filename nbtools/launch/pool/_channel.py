"""The command channel between a :class:`~nbtools.launch.RankPool` and its ranks.

One stream socket per rank, opened by the rank to the kernel once its process
group is up. Local ranks use a Unix socket in a private (0700) directory:
nothing listens on a TCP port. Ranks on a cluster use TCP on the node's
address.

Authentication comes before anything else, as in SSH and Jupyter. The kernel
sends a random challenge; the rank answers with a fixed-size HMAC of it under
the pool's key and a challenge of its own, which the kernel answers in turn
(mutual: a rank never talks to an impostor either). Until a peer has proved the
key, nothing it sent is interpreted beyond comparing a fixed number of bytes
with :func:`hmac.compare_digest`; only then may it send frames. Connections are
handshaken side by side without blocking (:meth:`Listener.poll`), so one silent
or hostile peer neither stalls nor aborts the start.

A frame is one pickle (protocol 5) and its out-of-band buffers
(:mod:`nbtools.launch.pool._frames`); to a local rank, large buffers go by
shared memory, written once for every rank (a pushed tensor). A large value
(a rank's result tensors, :func:`nbtools.launch._results.pack`) is thus
pickled once and sent from its own memory; the reader receives each buffer
into memory of its own and unpickles with them in place. The kernel reads
without blocking into a per-rank buffer (:meth:`Link.frames`): an interrupt
between two reads loses nothing. Writes always complete a frame, whatever its
size, even when interrupted, so the stream never desynchronises; a second
interrupt while one frame is still being written gives up on the link.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import pickle
import select
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.launch.pool._frames import (
    HEADER,
    LENGTH,
    SHARED_FLAG,
    Frame,
    Parts,
    frame,
    memory,
    open_shared,
)

__all__ = [
    "Listener",
    "Link",
    "connect",
    "frame",
    "wait_readable",
    "ChannelClosed",
    "socket_directory",
]

_log = get_logger("launch")
# More buffers than this in one frame: not a frame nbtools wrote.
_MAX_BUFFERS = 1 << 20
_CHALLENGE_BYTES = 32
_DIGEST_BYTES = hashlib.sha256().digest_size
# What a rank sends before it is trusted: its proof, then its own challenge.
_ANSWER_BYTES = _DIGEST_BYTES + _CHALLENGE_BYTES
# Each side's proof is bound to its role, so one side's answer never serves as the other's.
_RANK_PROOF = b"nbtools pool rank\0"
_KERNEL_PROOF = b"nbtools pool kernel\0"
_RECV_CHUNK = 1 << 20
# At most this much is read per call of Link.frames, so output is forwarded during big frames.
_READ_PER_CALL = 64 << 20
# A connection that does not complete the handshake in this time is dropped.
_HANDSHAKE_S = 30.0
# At most this many connections are handshaken at once; beyond, the oldest is dropped.
_MAX_PENDING = 64
# sun_path holds 108 bytes on Linux, the terminating NUL included; macOS 104.
_MAX_UNIX_PATH = 100
# How long a blocked write waits before it reports progress to its caller.
_WRITE_WAIT_S = 0.05


class ChannelClosed(ConnectionError):
    """The other end of a link has gone away (or the link can no longer be used)."""


def _proof(key: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, role + challenge, hashlib.sha256).digest()


class Link:
    """One rank's end-to-end stream of frames.

    Args:
        sock: a connected stream socket (kernel side: non-blocking).
        rank: the rank at the other end (kernel side), or this rank (rank side).
    """

    def __init__(self, sock: socket.socket, rank: int = -1, share_memory: bool = False) -> None:
        self.sock = sock
        #: Large buffers go to the other end by shared memory (kernel side, local ranks).
        self.share_memory = share_memory
        self.rank = rank
        self.closed = False
        # Reading a frame, one part after the other: the header, the buffers' lengths,
        # then the pickle and the buffers (``_parts``); ``_into`` is the part being filled.
        self._head = bytearray(HEADER.size)
        self._into = self._head
        self._got = 0
        self._size = 0
        self._parts: list[Any] = []

    def send(self, message: Any, waiting: Callable[[], None] | None = None) -> None:
        """Send one message; an interrupt while sending still completes the frame."""
        self.send_frame(frame(message), waiting)

    def send_frame(self, data: Frame, waiting: Callable[[], None] | None = None) -> None:
        """Send an already framed message (the same frame may go to every rank).

        Args:
            data: from :func:`frame`.
            waiting: called while the other end is not reading (it may raise to give up).

        Raises:
            ChannelClosed: the other end went away, or a second interrupt gave up
                on a frame half written (the link is unusable then).
        """
        if self.closed:
            raise ChannelClosed(f"rank {self.rank}'s channel is closed")
        interrupted: KeyboardInterrupt | None = None
        if self.share_memory and isinstance(data, Parts):
            data = data.for_local_rank()
        for part in data:
            view = memoryview(part).cast("B")
            sent = 0
            while sent < len(view):
                try:
                    try:
                        sent += self.sock.send(view[sent:])
                    except (BlockingIOError, InterruptedError):
                        select.select([], [self.sock], [], _WRITE_WAIT_S)
                        if waiting is not None:
                            waiting()
                except KeyboardInterrupt as exc:
                    if interrupted is not None:
                        self.close()  # half a frame is out: the stream cannot be used any more
                        raise
                    interrupted = exc  # finish the frame, then let the interrupt through
                except OSError as exc:
                    self.close()
                    raise ChannelClosed(f"rank {self.rank}'s channel failed: {exc}") from exc
                except BaseException:
                    self.close()  # the caller gave up mid-frame: the stream is out of step
                    raise
        if interrupted is not None:
            raise interrupted

    def frames(self) -> list[Any]:
        """Every complete message readable now, without blocking (kernel side).

        Raises:
            ChannelClosed: the other end closed the connection (after what it sent).
        """
        messages: list[Any] = []
        eof = False
        budget = _READ_PER_CALL
        while budget > 0:
            buffer = memoryview(self._into)[self._got :]
            try:
                count = self.sock.recv_into(
                    buffer, min(len(buffer), _RECV_CHUNK), socket.MSG_DONTWAIT
                )
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if count == 0:
                eof = True
                break
            budget -= count
            self._got += count
            self._advance(messages)
        if eof:
            self.closed = True
            if not messages:
                raise ChannelClosed(f"rank {self.rank} closed its channel")
        return messages

    def _advance(self, messages: list[Any]) -> None:
        """Move past every part that is complete; a frame complete now joins ``messages``."""
        while self._got == len(self._into):
            if self._into is self._head:
                self._size, count = HEADER.unpack(self._head)
                if count > _MAX_BUFFERS:
                    raise ChannelClosed(f"rank {self.rank} sent a frame of {count} parts")
                self._parts = []
                self._into = bytearray(count * LENGTH.size)  # the buffers' lengths
            elif not self._parts:
                lengths = [n for (n,) in LENGTH.iter_unpack(self._into)]
                self._parts = [bytearray(self._size), *(memory(n) for n in lengths)]
                self._into = self._parts[0]
            else:
                index = next(i for i, part in enumerate(self._parts) if part is self._into) + 1
                if index < len(self._parts):
                    self._into = self._parts[index]
                else:
                    messages.append(pickle.loads(self._parts[0], buffers=self._parts[1:]))
                    self._parts = []
                    self._into = self._head
                    self._got = 0
                    return
            self._got = 0

    def recv(self) -> Any:
        """Block until one message arrives (rank side)."""
        size, count = HEADER.unpack(self._exactly(HEADER.size))
        if count & SHARED_FLAG:
            (length,) = LENGTH.unpack(self._exactly(LENGTH.size))
            buffers = open_shared(bytes(self._exactly(length)))
            return pickle.loads(self._exactly(size), buffers=buffers)
        if count > _MAX_BUFFERS:
            raise ChannelClosed(f"the kernel sent a frame of {count} parts")
        lengths = [n for (n,) in LENGTH.iter_unpack(self._exactly(count * LENGTH.size))]
        data = self._exactly(size)
        return pickle.loads(data, buffers=[self._exactly(n, memory(n)) for n in lengths])

    def _exactly(self, size: int, into: bytearray | mmap.mmap | None = None) -> Any:
        data = bytearray(size) if into is None else into
        view = memoryview(data)
        got = 0
        while got < size:
            count = self.sock.recv_into(view[got:], min(size - got, _RECV_CHUNK))
            if count == 0:
                self.closed = True
                raise ChannelClosed("the other end closed the channel")
            got += count
        return data

    def close(self) -> None:
        """Close the socket; idempotent."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class _Handshake:
    """One connection being authenticated by the kernel, without blocking."""

    def __init__(self, sock: socket.socket, key: bytes, world_size: int) -> None:
        self.sock = sock
        self.key = key
        self.world_size = world_size
        self.deadline = time.monotonic() + _HANDSHAKE_S
        self.challenge = os.urandom(_CHALLENGE_BYTES)
        self.answer = bytearray()
        self.link: Link | None = None  # once the peer proved the key
        sock.setblocking(False)
        sock.send(self.challenge)  # 32 bytes into a fresh socket's buffer

    def step(self) -> dict | None:
        """Advance; the rank's hello once it is in, None while waiting.

        Raises:
            ChannelClosed: the peer failed the handshake (or went away).
        """
        if self.link is None:
            try:
                chunk = self.sock.recv(_ANSWER_BYTES - len(self.answer))
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                raise ChannelClosed(f"the connection failed: {exc}") from exc
            if not chunk:
                raise ChannelClosed("the peer closed the connection during the handshake")
            self.answer += chunk
            if len(self.answer) < _ANSWER_BYTES:
                return None
            digest = bytes(self.answer[:_DIGEST_BYTES])
            if not hmac.compare_digest(digest, _proof(self.key, _RANK_PROOF, self.challenge)):
                raise ChannelClosed("the peer did not prove the pool's key")
            theirs = bytes(self.answer[_DIGEST_BYTES:])
            self.link = Link(self.sock, share_memory=self.sock.family == socket.AF_UNIX)
            # The kernel's proof: raw bytes, like the challenge (written whole, as a frame is).
            self.link.send_frame((_proof(self.key, _KERNEL_PROOF, theirs), b""))
        # Authenticated: the first frame is the rank's hello.
        try:
            messages = self.link.frames()
        except (ChannelClosed, pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise ChannelClosed(f"the rank's introduction failed: {exc}") from exc
        if not messages:
            return None
        hello = messages[0]
        rank = hello.get("rank") if isinstance(hello, dict) else None
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ChannelClosed(f"the rank's introduction is not valid: {hello!r:.200}")
        self.link.rank = rank
        # A rank that cannot open the kernel's memory files gets large buffers by socket.
        self.link.share_memory = self.link.share_memory and hello.get("shared_memory") is True
        return hello

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Listener:
    """The kernel's end: accepts authenticated rank connections.

    Args:
        world_size: how many ranks will connect (rank numbers are checked against it).
        directory: for local ranks, a private directory for the Unix socket
            (a short one is used instead when its path would be too long).
        host: for ranks elsewhere, the address to listen on (TCP, any free port).
    """

    def __init__(
        self, world_size: int, *, directory: str | None = None, host: str | None = None
    ) -> None:
        self.key = os.urandom(32)
        self.world_size = world_size
        self._pending: list[_Handshake] = []
        self._own_directory: str | None = None
        if host is None:
            if directory is None:
                raise ValueError("a Listener needs a directory (local ranks) or a host")
            path = os.path.join(directory, "pool.sock")
            if len(os.fsencode(path)) > _MAX_UNIX_PATH:
                self._own_directory = socket_directory()
                path = os.path.join(self._own_directory, "pool.sock")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(path)
            self.address: str | tuple[str, int] = path
        else:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.bind((host, 0))
            self.address = (host, self._sock.getsockname()[1])
        self._sock.listen(64)
        self._sock.setblocking(False)

    def fileno(self) -> int:
        return self._sock.fileno()

    def sockets(self) -> list[Any]:
        """What to wait on for progress: the listening socket and every handshake."""
        return [self._sock, *(h.sock for h in self._pending)]

    def poll(self) -> list[tuple[Link, dict]]:
        """Accept what is waiting and advance every handshake, without blocking.

        Returns:
            The links of ranks that completed the handshake now, each with the
            rank's hello message (``{"rank", "pid", "host"}``).
        """
        while True:
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # out of descriptors, or similar: try again later
                _log.warning("the pool's channel could not accept a connection: %s", exc)
                break
            if len(self._pending) >= _MAX_PENDING:
                self._drop(self._pending[0], "too many connections waiting")
            try:
                self._pending.append(_Handshake(sock, self.key, self.world_size))
            except OSError:
                sock.close()
        ready = []
        now = time.monotonic()
        for handshake in list(self._pending):
            try:
                hello = handshake.step()
            except ChannelClosed as exc:
                self._drop(handshake, str(exc))
                continue
            if hello is not None:
                self._pending.remove(handshake)
                assert handshake.link is not None
                if handshake.sock.family == socket.AF_INET:
                    handshake.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ready.append((handshake.link, hello))
            elif now > handshake.deadline:
                self._drop(handshake, f"no handshake within {_HANDSHAKE_S:.0f} s")
        return ready

    def _drop(self, handshake: _Handshake, why: str) -> None:
        self._pending.remove(handshake)
        handshake.close()
        _log.warning("the pool's channel refused a connection: %s", why)

    def close(self) -> None:
        """Stop listening (remove the socket file, drop handshakes); idempotent."""
        for handshake in self._pending:
            handshake.close()
        self._pending.clear()
        address = self.address
        try:
            self._sock.close()
        except OSError:
            pass
        if isinstance(address, str):
            for remove, path in ((os.unlink, address), (os.rmdir, self._own_directory)):
                if path is not None:
                    try:
                        remove(path)
                    except OSError:
                        pass


def socket_directory() -> str:
    """A new private (0700) directory with a short path, for a Unix socket.

    ``$XDG_RUNTIME_DIR`` (the user's own) when it is short, else ``/tmp``.

    Raises:
        LaunchError: no short directory can be made; the message says what to set.
    """
    from nbtools.errors import LaunchError

    candidates = [os.environ.get("XDG_RUNTIME_DIR", ""), "/tmp", "/dev/shm"]
    for base in candidates:
        if not base or len(os.fsencode(base)) > _MAX_UNIX_PATH - 30 or not _private_base(base):
            continue
        try:
            return tempfile.mkdtemp(prefix="nbtools-", dir=base)  # 0700, ours, a fresh name
        except OSError:
            continue
    raise LaunchError(
        "the pool's socket path would be longer than Unix sockets allow, and no short "
        "directory (XDG_RUNTIME_DIR, /tmp) can be used: set TMPDIR to a shorter directory"
    )


def _private_base(base: str) -> bool:
    """Whether a new directory made in ``base`` stays ours (ours, or sticky like /tmp)."""
    try:
        info = os.stat(base)
    except OSError:
        return False
    return info.st_uid == os.getuid() or bool(info.st_mode & 0o1000)


def connect(address: str | tuple[str, int], key: bytes, hello: dict) -> Link:
    """Open this rank's link to the kernel (rank side), authenticate both ends, introduce it.

    Raises:
        ChannelClosed: the other end did not prove the pool's key.
    """
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    deadline = time.monotonic() + _HANDSHAKE_S
    while True:
        try:
            sock.connect(address)
            break
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.05)
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(_HANDSHAKE_S)
    link = Link(sock, int(hello["rank"]))
    try:
        challenge = bytes(link._exactly(_CHALLENGE_BYTES))
        mine = os.urandom(_CHALLENGE_BYTES)
        sock.sendall(_proof(key, _RANK_PROOF, challenge) + mine)
        theirs = bytes(link._exactly(_DIGEST_BYTES))
        if not hmac.compare_digest(theirs, _proof(key, _KERNEL_PROOF, mine)):
            raise ChannelClosed(f"{address} did not prove the pool's key; not the kernel")
        sock.settimeout(None)
        link.send(hello)
    except BaseException:
        link.close()
        raise
    return link


def wait_readable(links: list[Link], listener: Listener | None, timeout: float) -> bool:
    """Block up to ``timeout`` seconds until a link or the listener has something to read.

    One ``poll`` call on a handful of sockets: no epoll descriptor made and closed per
    wait, which a warm pool call pays a few times.
    """
    poller = select.poll()
    for link in links:
        if not link.closed:
            poller.register(link.sock, select.POLLIN)
    if listener is not None:
        for sock in listener.sockets():
            poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))
