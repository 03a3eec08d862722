"""The command channel between a :class:`~nbtools.launch.RankPool` and its ranks.

One stream socket per rank, opened by the rank to the kernel once its process
group is up. Local ranks use a Unix socket in the attempt's private (0700)
directory: nothing listens on a TCP port. Ranks on a cluster use TCP on the
kernel's address. Either way a rank proves it holds the pool's key before the
kernel accepts it (an HMAC over a random challenge, as ``multiprocessing``'s
connections do), so nothing else on the network can send commands to ranks.

Frames are a 8-byte big-endian length followed by a pickle. The kernel reads
without blocking into a per-rank buffer (:meth:`Link.frames`): an interrupt
between two reads loses nothing. Writes always complete a frame, even when
interrupted, so the stream never desynchronises.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import selectors
import socket
import struct
import time
from typing import Any

__all__ = ["Listener", "Link", "connect", "frame", "wait_readable", "ChannelClosed"]

_HEADER = struct.Struct("!Q")
_CHALLENGE_BYTES = 32
_RECV_CHUNK = 1 << 20
# A connection that does not complete the handshake in this time is dropped.
_HANDSHAKE_S = 30.0


class ChannelClosed(ConnectionError):
    """The other end of a link has gone away."""


def frame(message: Any) -> bytes:
    """``message`` as one frame: its length, then its pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


class Link:
    """One rank's end-to-end stream of frames.

    Args:
        sock: a connected stream socket.
        rank: the rank at the other end (kernel side), or this rank (rank side).
    """

    def __init__(self, sock: socket.socket, rank: int = -1) -> None:
        self.sock = sock
        self.rank = rank
        self._buffer = bytearray()
        self.closed = False

    def send(self, message: Any) -> None:
        """Send one message; an interrupt while sending still completes the frame."""
        self.send_frame(frame(message))

    def send_frame(self, frame: bytes) -> None:
        """Send an already framed message (the same bytes may go to every rank)."""
        view = memoryview(frame)
        sent = 0
        interrupted: KeyboardInterrupt | None = None
        while sent < len(view):
            try:
                sent += self.sock.send(view[sent:])
            except KeyboardInterrupt as exc:
                interrupted = exc  # finish the frame, then let the interrupt through
            except (BrokenPipeError, ConnectionResetError) as exc:
                self.closed = True
                raise ChannelClosed(f"rank {self.rank} closed its channel") from exc
        if interrupted is not None:
            raise interrupted

    def frames(self) -> list[Any]:
        """Every complete message readable now, without blocking (kernel side).

        Raises:
            ChannelClosed: the other end closed the connection (after what it sent).
        """
        eof = False
        while True:
            try:
                chunk = self.sock.recv(_RECV_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except (ConnectionResetError, OSError):
                eof = True
                break
            if not chunk:
                eof = True
                break
            self._buffer += chunk
            if len(chunk) < _RECV_CHUNK:
                break
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + size:
                break
            data = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
            del self._buffer[: _HEADER.size + size]
            messages.append(pickle.loads(data))
        if eof:
            self.closed = True
            if not messages:
                raise ChannelClosed(f"rank {self.rank} closed its channel")
        return messages

    def recv(self) -> Any:
        """Block until one message arrives (rank side)."""
        header = self._exactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return pickle.loads(self._exactly(size))

    def _exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.sock.recv(min(size - len(data), _RECV_CHUNK))
            if not chunk:
                self.closed = True
                raise ChannelClosed("the kernel closed the channel")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        """Close the socket; idempotent."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class Listener:
    """The kernel's end: accepts authenticated rank connections.

    Args:
        directory: for local ranks, where the Unix socket is created.
        host: for ranks elsewhere, the address to listen on (TCP, any free port).
    """

    def __init__(self, *, directory: str | None = None, host: str | None = None) -> None:
        self.key = os.urandom(32)
        if host is None:
            if directory is None:
                raise ValueError("a Listener needs a directory (local ranks) or a host")
            path = os.path.join(directory, "pool.sock")
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

    def accept(self) -> tuple[Link, dict] | None:
        """Accept one waiting connection and authenticate it; None if none is waiting.

        Returns:
            The link and the rank's hello message (``{"rank", "pid", "host"}``).
        """
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        sock.setblocking(True)
        sock.settimeout(_HANDSHAKE_S)
        link = Link(sock)
        try:
            challenge = os.urandom(_CHALLENGE_BYTES)
            link.send(challenge)
            answer = link.recv()
            if not (isinstance(answer, tuple) and len(answer) == 2):
                raise ChannelClosed("malformed handshake")
            digest, hello = answer
            if not hmac.compare_digest(digest, _digest(self.key, challenge)):
                raise ChannelClosed("wrong key")
        except (OSError, ChannelClosed, pickle.UnpicklingError, EOFError):
            link.close()
            return None
        sock.settimeout(None)
        sock.setblocking(False)
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link.rank = int(hello["rank"])
        return link, hello

    def close(self) -> None:
        """Stop listening (and remove the socket file); idempotent."""
        address = self.address
        try:
            self._sock.close()
        except OSError:
            pass
        if isinstance(address, str):
            try:
                os.unlink(address)
            except OSError:
                pass


def connect(address: str | tuple[str, int], key: bytes, hello: dict) -> Link:
    """Open this rank's link to the kernel (rank side) and introduce it."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    deadline = time.monotonic() + _HANDSHAKE_S
    while True:
        try:
            sock.connect(address)
            break
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    link = Link(sock, int(hello["rank"]))
    challenge = link.recv()
    link.send((_digest(key, challenge), hello))
    return link


def wait_readable(links: list[Link], listener: Listener | None, timeout: float) -> bool:
    """Block up to ``timeout`` seconds until a link or the listener has something to read."""
    with selectors.DefaultSelector() as selector:
        for link in links:
            if not link.closed:
                selector.register(link.sock, selectors.EVENT_READ)
        if listener is not None:
            selector.register(listener.fileno(), selectors.EVENT_READ)
        return bool(selector.select(timeout))
