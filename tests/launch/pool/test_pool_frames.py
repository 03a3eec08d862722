"""A pool rank's large result is pickled once and sent from its own memory."""

from __future__ import annotations

import socket
import threading

import numpy as np
import torch

from nbtools.launch import _results
from nbtools.launch.pool._channel import Link, frame, wait_readable


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _received(parts_list: list) -> list:
    """What a kernel-side link reads of these frames, sent by a rank on the other end."""
    kernel_end, rank_end = socket.socketpair()
    kernel, rank = Link(kernel_end, 0), Link(rank_end, 0)
    kernel_end.setblocking(False)

    def send() -> None:
        for parts in parts_list:
            rank.send_frame(parts)

    sender = threading.Thread(target=send)
    sender.start()
    messages: list = []
    try:
        while len(messages) < len(parts_list):
            wait_readable([kernel], None, 0.05)
            messages += kernel.frames()
    finally:
        sender.join()
        kernel.close()
        rank.close()
    return messages


def test_a_large_result_is_pickled_once_and_sent_from_its_own_memory():
    value = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    parts = frame((3, "ok", _results.pack(value), False))
    # The tensor's bytes are a part of the frame of their own, in the tensor's own memory:
    # nothing copied them into a pickle, and the pickle that describes them is small.
    owned = [p for p in parts if memoryview(p).nbytes == value.nbytes]
    assert [_address(p) for p in owned] == [value.data_ptr()]
    assert sum(memoryview(p).nbytes for p in parts) < value.nbytes + 4096
    [(seq, kind, framed, wrote)] = _received([parts])
    assert (seq, kind, wrote) == (3, "ok", False)
    assert torch.equal(framed.loads(), value)


def test_frames_with_and_without_buffers_follow_one_another_on_a_link():
    array = np.arange(300_000, dtype=np.int64)  # out of band, as NumPy pickles it
    tensors = [torch.full((200_000,), 2.0), torch.ones(3)]  # one large, one small
    sent = [
        frame((1, "run", b"payload")),
        frame((2, "ok", _results.pack({"a": array, "t": tensors, "s": "text"}), True)),
        frame((3, "ok", _results.pack(None), False)),
    ]
    assert [len(parts) for parts in sent] == [1, 4, 1]
    first, second, third = _received(sent)
    assert first == (1, "run", b"payload")
    value = second[2].loads()
    assert np.array_equal(value["a"], array) and value["s"] == "text"
    assert torch.equal(value["t"][0], tensors[0]) and torch.equal(value["t"][1], tensors[1])
    value["t"][0][0] = 5.0  # received into memory of its own: writable
    assert third[2].loads() is None
