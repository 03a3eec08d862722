"""Read once per job: which rank fetches each stored range, and the hand-off to the others.

DCP's global load plan (on the coordinator) names every rank's ``ReadItem``s;
each points at a stored record, a byte range ``(file, offset, length)``. A
record one rank needs is fetched by that rank. A record several ranks need is
fetched by one of them, the one with the fewest bytes to fetch so far (largest
records first), and then broadcast over the process group in messages of at
most ``chunk_size`` bytes (the reader passes a quarter chunk). The messages
are ordered round-robin over the fetching ranks, so all of them read from the
volume at once while the broadcasts run; every rank is given the same message
list in its plan, so every rank takes part in the same sequence of broadcasts.
Each fetching rank fetches its messages in that order, about one at a time, so
the first ones are broadcast while the later ones are still being fetched.

A message starts with a status word and, per record segment, where the
record's tensor data lies in it. A fetching rank sends a message only for
records it has fetched and verified; when that failed (a stall, a checksum
that does not match) it sends the error instead, and every rank raises it at
the same message, so no rank is left waiting in a collective.

Several messages are in flight at once (async broadcasts, in buffers of two
chunks in all). Buffers are CPU tensors on a gloo group; CUDA tensors on an
NCCL group (where a group has both, CUDA when the load has destinations on a
GPU). A record whose destination is a dense CPU tensor of its dtype and shape
is copied from the message straight into it; any other record is written to
the sparse staging files, from which the load itself reads: once per node, as
the ranks of a node share their staging directory (``Receiver.stages``). A rank
holds the message buffers (two chunks) beyond its own state.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from nbtools.errors import CheckpointError, CheckpointStallError, CorruptCheckpointError

__all__ = ["Key", "NOTE", "Receiver", "plan_reads", "exchange", "group_of", "describe_group"]

#: A stored record: ``(relative_path, offset, length)``.
Key = tuple[str, int, int]
#: The key of the reader's notes in ``LoadPlan.storage_data``.
NOTE = "nbtools_read"
_HEADER = 16
_MIN_MESSAGE = 4096
_ERRORS: dict[int, type[CheckpointError]] = {
    1: CheckpointStallError,
    2: CorruptCheckpointError,
    3: CheckpointError,
}


def group_of(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group the hand-off runs on (the default one for None); None without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD if process_group is None else process_group


def describe_group(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(this process's rank in group, group size)``; rank -1 when not a member."""
    return dist.get_rank(group), dist.get_world_size(group)


def plan_reads(
    needs: Sequence[Iterable[Key]], chunk_size: int
) -> tuple[list[list[Key]], list[tuple[int, tuple[tuple[Key, int, int], ...]]], int]:
    """Assign each record to one fetching rank and order the hand-off messages.

    Args:
        needs: Per rank, the records its plan reads.
        chunk_size: The most payload bytes of one message.

    Returns:
        ``(fetch, messages, shared_bytes)``: per rank the records it fetches
        (handed-over ones first, in message order); the messages as
        ``(fetching rank, ((record, start, length), ...))``; the bytes handed over.
    """
    world = len(needs)
    wanted: dict[Key, list[int]] = {}
    for rank, keys in enumerate(needs):
        for key in dict.fromkeys(keys):
            wanted.setdefault(key, []).append(rank)
    load = [0] * world
    own: list[list[Key]] = [[] for _ in range(world)]
    for key, ranks in wanted.items():
        if len(ranks) == 1:
            own[ranks[0]].append(key)
            load[ranks[0]] += key[2]
    shared: list[list[Key]] = [[] for _ in range(world)]
    for key in sorted((k for k, r in wanted.items() if len(r) > 1), key=lambda k: (-k[2], k)):
        reader = min(wanted[key], key=lambda r: (load[r], r))
        shared[reader].append(key)
        load[reader] += key[2]
    queues = [sorted(keys, key=lambda k: (k[0], k[1])) for keys in shared]
    messages: list[tuple[int, tuple[tuple[Key, int, int], ...]]] = []
    cursor = [(0, 0)] * world  # (index in queue, bytes of that record already sent)
    active = [r for r in range(world) if queues[r]]
    while active:
        for reader in list(active):
            index, sent = cursor[reader]
            segments: list[tuple[Key, int, int]] = []
            room = chunk_size
            while room > 0 and index < len(queues[reader]):
                key = queues[reader][index]
                n = min(room, key[2] - sent)
                segments.append((key, sent, n))
                room -= n
                sent += n
                if sent >= key[2]:
                    index, sent = index + 1, 0
            cursor[reader] = (index, sent)
            if segments:
                messages.append((reader, tuple(segments)))
            if index >= len(queues[reader]):
                active.remove(reader)
    fetch = [queues[r] + sorted(own[r], key=lambda k: (k[0], k[1])) for r in range(world)]
    return fetch, messages, sum(k[2] for q in queues for k in q)


def _device(group: dist.ProcessGroup | None, cuda_destinations: bool) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return torch.device("cpu")
    if "gloo" in backend:
        flag = torch.tensor([1 if cuda_destinations else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _error_code(exc: BaseException) -> int:
    if isinstance(exc, CheckpointStallError):
        return 1
    if isinstance(exc, CorruptCheckpointError):
        return 2
    return 3


class Receiver(Protocol):
    """How a rank takes the records handed to it (see :func:`exchange`)."""

    def frame(self, key: Key) -> tuple[int, int]:
        """On the fetching rank, after the record is staged and verified: ``(offset,
        nbytes)`` of its tensor data inside the record, when those bytes are the
        tensor's memory as it is (else ``(-1, 0)``)."""

    def sink(self, key: Key, offset: int, nbytes: int) -> torch.Tensor | None:
        """The uint8 CPU tensor the data bytes of ``key`` go straight into (its
        destination's memory), or None to stage the record."""

    def done(self, key: Key) -> None:
        """All data bytes of a sunk record arrived."""

    def stages(self, key: Key, reader: int) -> bool:
        """Whether this rank writes a record that ``reader`` handed over, and that it does
        not sink, to the staging file (False: another rank of its node does, in the
        staging directory they share)."""


def _header_size(segments: tuple[tuple[Key, int, int], ...]) -> int:
    return _HEADER + 16 * len(segments)


def exchange(
    group: dist.ProcessGroup | None,
    me: int,
    messages: list[tuple[int, tuple[tuple[Key, int, int], ...]]],
    *,
    needed: set[Key],
    ready: Callable[[Key], None],
    staged: Callable[[str], str],
    cuda_destinations: Callable[[], bool],
    on_bytes: Callable[[int], None],
    timings: Any,
    delivery: Receiver,
    memory: int,
) -> None:
    """Run the broadcasts of ``messages`` on this rank (every rank calls it alike).

    Several messages are in flight at once (as many as ``memory`` holds, at least
    two), each in its own buffer: while some are broadcast, this rank fills the
    next (when it fetched it) or takes the bytes of the earliest. A record whose destination is a matching CPU tensor is
    copied from the message straight into it; any other one is written to its
    staging file, from which the load reads it.

    Args:
        group: The process group.
        me: This rank in ``group``.
        messages: From :func:`plan_reads`.
        needed: The records this rank's plan reads.
        ready: Waits until a record this rank fetches is staged and verified (raises
            what went wrong).
        staged: The local staging file of a relative path.
        cuda_destinations: Whether this rank loads into CUDA tensors.
        on_bytes: Called with the payload bytes of each message fetched by another rank.
        timings: A :class:`~nbtools.checkpoint._storage._staged_read.Timings` to add phases to.
        delivery: Where handed-over records go on this rank.
        memory: Bytes of message buffers (at least two messages are in flight).
    """
    if not messages:
        return
    device = _device(group, cuda_destinations())
    biggest = max(
        _header_size(segs) + max(_MIN_MESSAGE, sum(n for _, _, n in segs)) for _, segs in messages
    )
    count = max(2, memory // biggest)
    buffers = [_Buffer(biggest, device) for _ in range(min(count, len(messages)))]
    sinks: dict[Key, tuple[torch.Tensor, int, int] | None] = {}
    writes: dict[Key, bool] = {}
    left: dict[Key, int] = {}
    flight: collections.deque[tuple[Any, _Buffer, int, Any, int, BaseException | None]] = (
        collections.deque()
    )

    def finish() -> None:
        work, buf, reader, segments, size, failure = flight.popleft()
        with timings.phase("broadcast"):
            work.wait()
        buf.arrived(size, reader == me)
        head = np.frombuffer(buf.view[: _header_size(segments)], dtype=np.int64)
        status, count = int(head[0]), int(head[1])
        if status:
            if failure is not None:
                raise failure
            text = bytes(buf.view[_HEADER : _HEADER + count]).decode("utf-8", "replace")
            raise _ERRORS.get(status, CheckpointError)(text)
        with timings.phase("unpack"):
            _unpack(buf, segments, head, reader)
        if reader != me:
            on_bytes(sum(n for _, _, n in segments))

    def _unpack(buf: _Buffer, segments: Any, head: Any, reader: int) -> None:
        at = _header_size(segments)
        mine = reader == me
        for index, (key, start, n) in enumerate(segments):
            if key in needed:
                if key not in sinks:
                    offset, nbytes = int(head[2 + 2 * index]), int(head[3 + 2 * index])
                    dest = delivery.sink(key, offset, nbytes) if offset >= 0 else None
                    sinks[key] = None if dest is None else (dest, offset, nbytes)
                    left[key] = nbytes
                    writes[key] = dest is None and not mine and delivery.stages(key, reader)
                sink = sinks[key]
                if sink is not None:
                    dest, offset, nbytes = sink
                    lo, hi = max(start, offset), min(start + n, offset + nbytes)
                    if hi > lo:
                        dest[lo - offset : hi - offset].copy_(
                            buf.host[at + lo - start : at + hi - start]
                        )
                        left[key] -= hi - lo
                        if not left[key]:
                            delivery.done(key)
                elif writes[key]:
                    fd = os.open(staged(key[0]), os.O_WRONLY | os.O_CREAT, 0o600)
                    try:
                        os.pwritev(fd, [buf.view[at : at + n]], key[1] + start)
                    finally:
                        os.close(fd)
            at += n

    try:
        for index, (reader, segments) in enumerate(messages):
            if len(flight) == len(buffers):
                finish()
            buf = buffers[index % len(buffers)]
            payload = sum(n for _, _, n in segments)
            size = _header_size(segments) + max(payload, _MIN_MESSAGE)
            failure: BaseException | None = None
            if reader == me:
                failure = _pack(buf, segments, payload, ready, staged, delivery, timings)
                buf.send(size)
            work = dist.broadcast(buf.wire[:size], group=group, group_src=reader, async_op=True)
            flight.append((work, buf, reader, segments, size, failure))
        while flight:
            finish()
    finally:
        # Every rank issued the same broadcasts: let those in flight end before raising.
        for work, *_ in flight:
            with contextlib.suppress(Exception):
                work.wait()


class _Buffer:
    """One message buffer: host memory, and the device tensor the broadcast runs on."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.host = torch.empty(size, dtype=torch.uint8)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.view = self.host.numpy().data
        self.wire = (
            self.host
            if device.type == "cpu"
            else torch.empty(size, dtype=torch.uint8, device=device)
        )

    def send(self, size: int) -> None:
        if self.wire is not self.host:
            self.wire[:size].copy_(self.host[:size])

    def arrived(self, size: int, mine: bool) -> None:
        if self.wire is not self.host and not mine:
            self.host[:size].copy_(self.wire[:size])


def _pack(
    buf: _Buffer,
    segments: tuple[tuple[Key, int, int], ...],
    payload: int,
    ready: Callable[[Key], None],
    staged: Callable[[str], str],
    delivery: Receiver,
    timings: Any,
) -> BaseException | None:
    """Fill ``buf`` with a message this rank fetched; on failure, with the error."""
    head = np.frombuffer(buf.view[: _header_size(segments)], dtype=np.int64)
    try:
        for key in dict.fromkeys(k for k, _, _ in segments):
            ready(key)
        packed = time.perf_counter()
        at = _header_size(segments)
        for index, (key, start, n) in enumerate(segments):
            head[2 + 2 * index : 4 + 2 * index] = delivery.frame(key)
            fd = os.open(staged(key[0]), os.O_RDONLY)
            try:
                got = os.preadv(fd, [buf.view[at : at + n]], key[1] + start)
            finally:
                os.close(fd)
            if got != n:
                raise CheckpointError(f"the staged copy of {key[0]} is short")
            at += n
        head[:2] = (0, payload)
        timings.add("pack", time.perf_counter() - packed)
        return None
    except BaseException as exc:  # noqa: BLE001 - every rank raises it when it arrives
        text = str(exc).encode("utf-8", "replace")[:_MIN_MESSAGE]
        at = _HEADER
        buf.view[at : at + len(text)] = text
        head[:2] = (_error_code(exc), len(text))
        return exc


def host() -> str:
    """This machine's name, for messages."""
    return socket.gethostname()
