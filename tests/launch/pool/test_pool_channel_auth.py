"""The pool's channel authenticates a peer before it interprets a byte from it.

Attackers here connect for real, to the real listener, while real ranks start:
one answers the challenge with a pickle that would create a file when
unpickled, one with garbage that makes ``pickle`` raise ``ValueError``, one
sends a byte now and then and never finishes. None of them may run code, abort
the start or hold it up.
"""

from __future__ import annotations

import glob
import os
import pickle
import socket
import struct
import tempfile
import threading
import time

import pytest

from nbtools.launch import RankPool
from nbtools.launch.pool._channel import ChannelClosed, Listener, connect, wait_readable


class _Planted:
    """Unpickling this creates ``path``: proof that a peer's bytes were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_frame(marker: str) -> bytes:
    data = pickle.dumps((b"\0" * 32, _Planted(marker)))
    return struct.pack("!Q", len(data)) + data


# Header then a pickle of protocol 9: pickle.loads raises ValueError on it.
_GARBAGE = struct.pack("!Q", 2) + b"\x80\x09" + b"\0" * 60


def _dial(address, stop: threading.Event) -> socket.socket | None:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    while not stop.is_set():
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            return sock
        except OSError:
            sock.close()
            time.sleep(0.01)
    return None


def _skip_challenge(sock: socket.socket) -> None:
    """Read what the listener sent first, whatever its framing, without waiting long."""
    sock.settimeout(2.0)
    try:
        sock.recv(4096)
    except OSError:
        pass


def _attack(address, kind: str, marker: str, stop: threading.Event) -> None:
    sock = _dial(address, stop)
    if sock is None:
        return
    with sock:
        try:
            _skip_challenge(sock)
            if kind == "pickle":
                sock.sendall(_evil_frame(marker))
            elif kind == "garbage":
                sock.sendall(_GARBAGE)
            # Every kind then stays connected; the slow one claims a big frame and trickles it.
            if kind == "slow":
                sock.sendall(struct.pack("!Q", 1 << 20))
            while not stop.wait(0.2):
                if kind == "slow":
                    sock.sendall(b"\0")
        except OSError:
            pass  # the listener hung up on us: what it should do


def _attackers(find_address, marker: str, stop: threading.Event) -> list[threading.Thread]:
    def run(kind: str) -> None:
        address = find_address(stop)
        if address is not None:
            _attack(address, kind, marker, stop)

    threads = [threading.Thread(target=run, args=(kind,)) for kind in ("pickle", "garbage", "slow")]
    for thread in threads:
        thread.start()
    return threads


def _new_pool_socket(before: set[str]):
    def find(stop: threading.Event) -> str | None:
        pattern = os.path.join(tempfile.gettempdir(), "nbtools-pool-*", "attempt*", "pool.sock")
        while not stop.is_set():
            fresh = sorted(set(glob.glob(pattern)) - before)
            if fresh:
                return fresh[0]
            time.sleep(0.005)
        return None

    return find


def test_attackers_during_the_start_run_no_code_and_do_not_stop_the_pool(tmp_path):
    marker = str(tmp_path / "planted")
    pattern = os.path.join(tempfile.gettempdir(), "nbtools-pool-*", "attempt*", "pool.sock")
    stop = threading.Event()
    threads = _attackers(_new_pool_socket(set(glob.glob(pattern))), marker, stop)
    try:
        with RankPool(processes=2, output="none") as pool:
            stop.set()  # the slow attacker was connected for the whole start
            assert pool.execute("6 * 7") == [42, 42]
            pool.push(v=3)
            assert pool.pull("v") == [3, 3]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not os.path.exists(marker), "a peer's bytes were unpickled before it proved the key"


def _rank(address, key: bytes, rank: int, links: dict) -> None:
    links[rank] = connect(address, key, {"rank": rank, "pid": os.getpid(), "host": "here"})


def test_tcp_listener_admits_ranks_with_the_key_while_attackers_hold_connections(tmp_path):
    marker = str(tmp_path / "planted")
    listener = Listener(2, host="127.0.0.1")
    stop = threading.Event()
    threads = _attackers(lambda _stop: listener.address, marker, stop)
    links: dict = {}
    admitted: dict = {}
    try:
        time.sleep(0.2)  # let the attackers connect first
        ranks = [
            threading.Thread(target=_rank, args=(listener.address, listener.key, r, links))
            for r in range(2)
        ]
        for thread in ranks:
            thread.start()
        while len(admitted) < 2:
            wait_readable([], listener, 0.05)
            for link, hello in listener.poll():
                admitted[link.rank] = (link, hello)
        for thread in ranks:
            thread.join()
        # Authenticated both ways: frames flow in both directions.
        links[1].send(("hello", 1))
        received = []
        while not received:
            wait_readable([admitted[1][0]], None, 0.05)
            received = admitted[1][0].frames()
        assert received == [("hello", 1)]
        assert admitted[0][1]["rank"] == 0
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for link, _ in admitted.values():
            link.close()
        for link in links.values():
            link.close()
        listener.close()
    assert not os.path.exists(marker)


def test_a_rank_does_not_unpickle_what_a_kernel_without_the_key_sends(tmp_path):
    marker = str(tmp_path / "planted")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    address = server.getsockname()

    def impostor() -> None:
        sock, _ = server.accept()
        with sock:
            sock.sendall(_evil_frame(marker) + b"\0" * 64)
            sock.settimeout(5.0)
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises((ChannelClosed, OSError)):
            connect(address, os.urandom(32), {"rank": 0, "pid": os.getpid(), "host": "here"})
    finally:
        thread.join()
        server.close()
    assert not os.path.exists(marker)
