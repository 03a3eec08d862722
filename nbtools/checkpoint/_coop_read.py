"""Read once per job: which rank fetches each stored range, and the hand-off to the others.

DCP's global load plan (on the coordinator) names every rank's ``ReadItem``s;
each points at a stored record, a byte range ``(file, offset, length)``. A
record one rank needs is fetched by that rank. A record several ranks need is
fetched by one of them, the one with the fewest bytes to fetch so far (largest
records first), and then broadcast over the process group in messages of at
most ``chunk_size`` bytes. The messages are ordered round-robin over the
fetching ranks, so all of them read from the volume at once while the
broadcasts run; every rank is given the same message list in its plan, so
every rank takes part in the same sequence of broadcasts.

A message starts with a status word. A fetching rank sends a message only for
records it has fetched and verified; when that failed (a stall, a checksum
that does not match) it sends the error instead, and every rank raises it at
the same message, so no rank is left waiting in a collective.

Buffers are CPU tensors on a gloo group; CUDA tensors on an NCCL group (where
a group has both, CUDA when the load has destinations on a GPU). Each rank
writes the bytes it needs to its sparse staging files, from which the load
itself reads: a rank holds one message buffer beyond its own state.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nbtools.errors import CheckpointError, CheckpointStallError, CorruptCheckpointError

__all__ = ["Key", "NOTE", "plan_reads", "exchange", "group_of", "describe_group"]

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


def group_of(process_group: Any) -> Any:
    """The group the hand-off runs on (the default one for None); None without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD if process_group is None else process_group


def describe_group(group: Any) -> tuple[int, int]:
    """``(this process's rank in group, group size)``; rank -1 when not a member."""
    return dist.get_rank(group), dist.get_world_size(group)


def plan_reads(
    needs: list[Iterable[Key]], chunk_size: int
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


def _device(group: Any, cuda_destinations: bool) -> torch.device:
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


def exchange(
    group: Any,
    me: int,
    messages: list[tuple[int, tuple[tuple[Key, int, int], ...]]],
    needed: set[Key],
    ready: Callable[[Key], None],
    staged: Callable[[str], str],
    chunk_size: int,
    cuda_destinations: bool,
    on_bytes: Callable[[int], None],
) -> None:
    """Run the broadcasts of ``messages`` on this rank (every rank calls it alike).

    Args:
        group: The process group.
        me: This rank in ``group``.
        messages: From :func:`plan_reads`.
        needed: The records this rank's plan reads.
        ready: Waits until a record this rank fetches is staged and verified (raises
            what went wrong).
        staged: The local staging file of a relative path.
        chunk_size: The most payload bytes of a message.
        cuda_destinations: Whether this rank loads into CUDA tensors.
        on_bytes: Called with the payload bytes of each message fetched by another rank.
    """
    if not messages:
        return
    device = _device(group, cuda_destinations)
    biggest = _HEADER + max(_MIN_MESSAGE, max(sum(n for _, _, n in segs) for _, segs in messages))
    biggest = min(biggest, _HEADER + max(chunk_size, _MIN_MESSAGE))
    host = torch.empty(biggest, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    view = memoryview(host.numpy())
    wire = host if device.type == "cpu" else torch.empty(biggest, dtype=torch.uint8, device=device)
    for reader, segments in messages:
        payload = sum(n for _, _, n in segments)
        size = _HEADER + max(payload, _MIN_MESSAGE)
        failure: BaseException | None = None
        if reader == me:
            try:
                for key in dict.fromkeys(k for k, _, _ in segments):
                    ready(key)
                at = _HEADER
                for (name, offset, _length), start, n in segments:
                    fd = os.open(staged(name), os.O_RDONLY)
                    try:
                        got = os.preadv(fd, [view[at : at + n]], offset + start)
                    finally:
                        os.close(fd)
                    if got != n:
                        raise CheckpointError(f"the staged copy of {name} is short")
                    at += n
                np.frombuffer(view[:_HEADER], dtype=np.int64)[:] = (0, payload)
            except BaseException as exc:  # noqa: BLE001 - every rank raises it below
                failure = exc
                text = str(exc).encode("utf-8", "replace")[: size - _HEADER]
                view[_HEADER : _HEADER + len(text)] = text
                np.frombuffer(view[:_HEADER], dtype=np.int64)[:] = (_error_code(exc), len(text))
            if wire is not host:
                wire[:size].copy_(host[:size])
        dist.broadcast(wire[:size], group=group, group_src=reader)
        if wire is not host and reader != me:
            host[:size].copy_(wire[:size])
        status, count = (int(x) for x in np.frombuffer(view[:_HEADER], dtype=np.int64))
        if status:
            if failure is not None:
                raise failure
            text = bytes(view[_HEADER : _HEADER + count]).decode("utf-8", "replace")
            raise _ERRORS.get(status, CheckpointError)(text)
        if reader == me:
            continue
        at = _HEADER
        for (name, offset, length), start, n in segments:
            if (name, offset, length) in needed:
                fd = os.open(staged(name), os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    os.pwritev(fd, [view[at : at + n]], offset + start)
                finally:
                    os.close(fd)
            at += n
        on_bytes(payload)


def host() -> str:
    """This machine's name, for messages."""
    return socket.gethostname()
