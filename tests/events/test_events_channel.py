"""The local channel in one process: a real named pipe, the emitter, the collector."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from nbtools.events import CHANNEL_ENV, Bus, Collector
from nbtools.events._emitter import THREAD_NAME, Emitter
from nbtools.events._sinks import FifoSink, open_sink
from nbtools.events._wire import BATCH_BYTES, MAX_EVENT_BYTES, decode_batch, encode_event


@pytest.fixture
def fifo(tmp_path):
    """A named pipe with a non-blocking read end that nobody reads unless the test does."""
    path = str(tmp_path / "events.fifo")
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    yield path, fd
    os.close(fd)


def _read_lines(fd: int) -> list[bytes]:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    assert data == b"" or data.endswith(b"\n")
    return [line for line in data.split(b"\n") if line]


def _record(i: int, message: str | None = None) -> tuple:
    # Stamped now: the bus forgets events older than two hours.
    return (time.time(), 0, "k", message, i, {"value": 0.5})


def test_a_full_pipe_drops_and_the_count_arrives_with_a_later_batch(fifo):
    path, fd = fifo
    emitter = Emitter(FifoSink(path), socket.gethostname(), os.getpid(), 0, capacity=100)
    total = 20_000
    try:
        for i in range(total):
            emitter.put(_record(i))
        delivered = dropped = 0
        steps: list[int] = []
        # Nobody read while the records went in: the pipe filled up, then the buffer.
        while True:
            done = emitter.flush(timeout=0)
            lines = _read_lines(fd)
            for line in lines:
                assert len(line) + 1 <= BATCH_BYTES
                _, d, events, _ = decode_batch(line)
                dropped += d
                delivered += len(events)
                steps.extend(e.step for e in events)
            if done and not lines:
                break
    finally:
        assert emitter.close(timeout=1)
    assert dropped > 0
    assert delivered + dropped == total, "every event is delivered or counted as dropped"
    assert steps == sorted(steps), "batches leave in order"


def test_the_flusher_thread_is_a_daemon_and_close_ends_it(fifo):
    import threading

    path, fd = fifo
    emitter = Emitter(FifoSink(path), "h", os.getpid(), None)
    emitter.put(_record(0))
    (thread,) = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert thread.daemon
    emitter.close(timeout=5)
    assert not thread.is_alive()
    (line,) = _read_lines(fd)
    assert decode_batch(line)[2][0].step == 0


def test_nobody_reading_loses_events_without_blocking(tmp_path):
    path = str(tmp_path / "gone.fifo")
    os.mkfifo(path)  # exists, but no reader: opening for writing fails with ENXIO
    emitter = Emitter(FifoSink(path), "h", os.getpid(), None)
    for i in range(10):
        emitter.put(_record(i))
    assert emitter.close(timeout=0.2) is False
    assert emitter._dropped == 10  # the count a later reader would receive


def test_a_huge_non_ascii_message_still_fits_one_atomic_write():
    message = "\U0001f600\x01" * 500  # 4-byte characters and 6-byte escapes
    data = encode_event((1.0, 0, "k", message, 1, {"a": "é" * 100}))
    assert len(data) <= MAX_EVENT_BYTES
    t, rank, kind, cut, step, fields = json.loads(data)
    assert cut.endswith("\u2026") and message.startswith(cut[:-1])
    assert fields == {"a": "é" * 100} and step == 1


def test_fields_that_bypassed_the_checks_are_replaced_not_sent_oversized():
    data = encode_event((1.0, 0, "k", None, 1, {f"f{i}": "\x01" * 400 for i in range(16)}))
    assert len(data) <= MAX_EVENT_BYTES
    assert json.loads(data)[5] == {"truncated": True}


@pytest.mark.parametrize(
    "line", [b"hello", b"{}", b'{"v":1}', b'{"v":2,"h":"a","p":1,"r":0,"d":0,"e":[]}']
)
def test_a_malformed_batch_is_a_value_error(line):
    with pytest.raises(ValueError, match="not an event batch|unknown batch version"):
        decode_batch(line)


def test_an_unknown_transport_is_a_value_error():
    with pytest.raises(ValueError, match="fifo"):
        open_sink("tcp://127.0.0.1:9")


# --- the collector -----------------------------------------------------------


def test_collector_delivers_what_was_written_and_skips_garbage(tmp_path):
    bus = Bus()
    collector = Collector(tmp_path, bus=bus)
    env = collector.environment()  # starts it
    assert env[CHANNEL_ENV] == "fifo:" + collector.path
    assert os.stat(collector.path).st_mode & 0o777 == 0o600
    emitter = Emitter(open_sink(env[CHANNEL_ENV]), "h", 42, 1)
    try:
        fd = os.open(collector.path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"not json\n")
        os.close(fd)
        for i in range(500):
            emitter.put(_record(i, message=f"m{i}"))
        assert emitter.flush(timeout=10)
    finally:
        emitter.close()
        path = collector.path
        collector.stop()
    assert not os.path.exists(path) and os.path.isdir(tmp_path)
    assert [e.step for e in bus.log()] == list(range(500))
    assert {(e.host, e.pid, e.rank) for e in bus.log()} == {("h", 42, 0)}
    assert bus.malformed() == 1


def test_collector_start_and_stop_are_idempotent_and_clean_up():
    collector = Collector(bus=Bus())
    collector.start()
    path = collector.path
    assert collector.start() is collector and collector.path == path
    collector.stop()
    collector.stop()
    assert not os.path.exists(os.path.dirname(path)), "its own directory is removed"
    assert collector.drain() == 0


def test_collector_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Collector(tmp_path / "missing").start()
    with pytest.raises(TypeError, match="Bus"):
        Collector(bus=[])
