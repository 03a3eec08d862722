"""Replicas: each rank's snapshot is also held by peers, sent over the job's process group.

Who holds whom: with ``replicas=k`` the snapshot of rank ``r`` is held by the
ranks ``r + L, r + 2L, ... r + kL`` (mod the world size), ``L`` the ranks of a
node: the same local rank on the next ``k`` nodes, so a lost node's snapshots
survive on other nodes. Ranks are laid out node by node (as the launchers do).
On a single node there is no other node; ``replicas`` asked for explicitly then
picks the next ``k`` ranks (``r + 1, ... r + k``), which survives a lost rank,
not a lost node, and lets one machine run the whole path.

The transfer runs on a gloo group of its own, made once per manager from the
job's process group (no new listener, no port): after each snapshot, every rank
sends its snapshot to its holders and receives those it holds, in the
background thread that finished writing its own slot. Every rank takes part in
every exchange, even one whose own snapshot failed (it says so in the header
and sends nothing), so no peer ever waits for a message that will not come.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nbtools.checkpoint._memory import _mappings, _slots

__all__ = [
    "peers",
    "holders",
    "sources",
    "new_group",
    "Outgoing",
    "exchange",
    "send_body",
    "receive_body",
]

_HEAD, _BODY, _TAIL = 0x5E1, 0x5E2, 0x5E3
#: Tags of a restore's transfers start here: two per owner (see :func:`send_body`).
_OWNER = 0x10000
#: How long a transfer may wait for a peer before the exchange fails (its snapshot is lost).
TIMEOUT = datetime.timedelta(minutes=10)


def peers(world: int, local: int) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of a job laid out node by node."""
    local = max(1, local)
    if world % local:
        return 1, world
    return world // local, local


def holders(rank: int, world: int, local: int, replicas: int) -> list[int]:
    """The ranks that hold ``rank``'s snapshot (see the module docstring)."""
    nodes, per_node = peers(world, local)
    stride, span = (per_node, nodes) if nodes > 1 else (1, world)
    return [(rank + j * stride) % world for j in range(1, min(replicas, span - 1) + 1)]


def sources(rank: int, world: int, local: int, replicas: int) -> list[int]:
    """The ranks whose snapshot ``rank`` holds."""
    nodes, per_node = peers(world, local)
    stride, span = (per_node, nodes) if nodes > 1 else (1, world)
    return [(rank - j * stride) % world for j in range(1, min(replicas, span - 1) + 1)]


def new_group() -> Any:
    """The replicas' gloo group: every rank of the job, made from its process group."""
    return dist.new_group(backend="gloo", timeout=TIMEOUT)


@dataclass
class Outgoing:
    """A snapshot to send: its tensor region and skeleton as ``uint8`` tensors."""

    step: int
    body: torch.Tensor
    tail: torch.Tensor
    crc: int


def _head(ok: bool, step: int, body: int, tail: int, crc: int) -> torch.Tensor:
    return torch.tensor([int(ok), step, body, tail, crc], dtype=torch.int64)


def exchange(
    group: Any,
    step: int,
    out: Outgoing | None,
    send_to: list[int],
    receive_from: list[int],
    sink: _mappings.ReplicaSink,
) -> list[tuple[int, str]]:
    """One round: send ``out`` (None: nothing this time) to ``send_to``, receive from
    ``receive_from`` into ``sink``'s replica files (``sink.receive(owner, step, body
    bytes)``). What went wrong
    with received snapshots, ``(owner, why)`` (their senders' are theirs to tell); a
    broken transfer raises."""
    head = _head(
        out is not None,
        step,
        *((out.body.numel(), out.tail.numel(), out.crc) if out else (0, 0, 0)),
    )
    heads = {s: torch.zeros(5, dtype=torch.int64) for s in receive_from}
    works: list[Any] = [dist.isend(head, dst=h, group=group, tag=_HEAD) for h in send_to]
    works += [dist.irecv(heads[s], src=s, group=group, tag=_HEAD) for s in receive_from]
    for work in works:
        work.wait()
    works = []
    if out is not None:
        for h in send_to:
            if out.body.numel():
                works.append(dist.isend(out.body, dst=h, group=group, tag=_BODY))
            works.append(dist.isend(out.tail, dst=h, group=group, tag=_TAIL))
    arriving = []
    for s in receive_from:
        ok, their_step, body, tail_len, crc = (int(v) for v in heads[s].tolist())
        if not ok:
            continue
        into = sink.receive(s, their_step, body)
        tail = torch.empty(tail_len, dtype=torch.uint8)
        if body:
            works.append(dist.irecv(into.body, src=s, group=group, tag=_BODY))
        works.append(dist.irecv(tail, src=s, group=group, tag=_TAIL))
        arriving.append((s, their_step, into, tail, crc))
    try:
        for work in works:
            work.wait()
    except BaseException:
        for _, _, into, _, _ in arriving:
            into.drop()
        raise
    errors = []
    for s, their_step, into, tail, crc in arriving:
        try:
            into.done(tail.numpy().tobytes(), crc)
        except Exception as exc:  # noqa: BLE001 - one replica lost, the exchange goes on
            errors.append((s, f"the replica of rank {s}'s step {their_step} was not kept ({exc})"))
    return errors


def _tags(owner: int) -> tuple[int, int]:
    """The tags of a transfer of ``owner``'s snapshot (one sender may send several)."""
    return _OWNER + 2 * owner, _OWNER + 2 * owner + 1


def send_body(
    group: Any, to: int, body: torch.Tensor | None, data_len: int, crc: int, owner: int
) -> list[Any]:
    """Start sending ``owner``'s whole payload (None: a refusal) to ``to``; the works to
    wait for."""
    head, data = _tags(owner)
    if body is None:
        return [dist.isend(_head(False, 0, 0, 0, 0), dst=to, group=group, tag=head)]
    works = [dist.isend(_head(True, 0, body.numel(), data_len, crc), dst=to, group=group, tag=head)]
    if body.numel():
        works.append(dist.isend(body, dst=to, group=group, tag=data))
    return works


def receive_body(group: Any, src: int, owner: int) -> tuple[Any, int, int] | None:
    """``owner``'s payload that :func:`send_body` sent: ``(body, tensor region bytes,
    crc)``, or None for a refusal."""
    head_tag, data_tag = _tags(owner)
    head = torch.zeros(5, dtype=torch.int64)
    dist.recv(head, src=src, group=group, tag=head_tag)
    ok, _, size, data_len, crc = (int(v) for v in head.tolist())
    if not ok:
        return None
    body = _slots.new_buffer(size)
    if size:
        dist.recv(torch.frombuffer(body, dtype=torch.uint8), src=src, group=group, tag=data_tag)
    return body, data_len, crc
