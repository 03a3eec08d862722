"""The layout of a snapshot: tensors as raw buffers, the rest as a small skeleton, shared by a node.

A snapshot's body (what follows a slot's header) is two regions:

- the tensor region: every tensor of the state, its raw bytes, each at an
  offset aligned to 64 bytes, in the order the state is walked;
- the skeleton: a ``torch.save`` of the state with each tensor replaced by a
  placeholder, plus the table of the tensors (dtype, shape, offset). It is a few
  kilobytes (step, optimizer hyper-parameters, the per-rank blob with the RNG
  streams) and is read back with ``torch.load(weights_only=True)``.

So a snapshot is written by copying each tensor once into its place (no
pickling of tensor data, no second copy), and read back by pointing tensors at
the bytes read (``torch.frombuffer``). The tensor region's layout depends only
on the names, shapes and dtypes of the state: it is planned once and reused
while they stay the same.

**Shares.** A checkpoint holds the model and optimizer tensors once, however many
ranks hold them (DCP writes a plain, replicated tensor from one rank); only the
per-rank part (RNG streams, data position, extras) is each rank's own. The
memory tier follows the same rule on each node: the ``L`` ranks of a node split
the model and optimizer tensors between them, by size, and each copies only its
share into its slot (where its skeleton names, for every other tensor, the rank
whose slot holds it). A snapshot then costs each rank ``1/L`` of the copy, and
the node ``1/L`` of the memory, that full copies would.

Restoring a step reads the slots of every rank of the node at that step (or
their replicas) and puts the tensors back where the skeleton says
(:func:`fill`). The split depends only on the names, dtypes and shapes of the
tensors, which every rank of a data-parallel job shares; the ranks check that
at the first snapshot (else each rank keeps its whole state, as before), and
every slot records a digest of them, so that shares of different layouts are
never put together.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from nbtools import runtime
from nbtools._internal.holder import machine_id
from nbtools.checkpoint import _state
from nbtools.checkpoint._collective import gather
from nbtools.checkpoint._memory import _sharded
from nbtools.errors import CheckpointError

__all__ = [
    "ALIGN",
    "KEY",
    "Layout",
    "PEER",
    "Share",
    "agree",
    "checksum",
    "decide",
    "decode",
    "destinations",
    "digest",
    "fill",
    "mark",
    "owners",
    "plan",
    "skeleton_bytes",
    "step_of",
    "worth_sharing",
]


#: Alignment of every tensor in the tensor region (a cache line; any dtype's).
ALIGN = 64
_REF = "__nbtools_tensor__"


def checksum(data: Any, value: int = 0) -> int:
    """CRC-32C of ``data`` (any buffer), continuing from ``value``: the checksum of every
    slot, replica and transfer of a snapshot.

    Computed with the CPU's CRC instruction where it has one (several GB/s, the GIL
    released), so that checking a restored snapshot costs a fraction of reading it.
    """
    return int(crc32c.crc32c(data, value))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a state goes in the tensor region.

    Attributes:
        tensors: The state's tensors, in walk order.
        table: ``(dtype name, shape, offset)`` of each, the offset from the body's start.
        skeleton: The state with each tensor replaced by ``{"__nbtools_tensor__": i}``.
        data_len: Bytes of the tensor region (aligned).
        signature: What the layout depends on; equal signatures give equal offsets.
    """

    tensors: list[torch.Tensor]
    table: list[tuple[str, tuple[int, ...], int]]
    skeleton: Any
    data_len: int
    signature: tuple[Any, ...]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan(state: dict[str, Any]) -> Layout:
    """The layout of ``state``'s tensors and its skeleton.

    Raises:
        TypeError: A tensor is a distributed or other tensor subclass (its
            placement cannot be written as raw bytes).
    """
    tensors: list[torch.Tensor] = []
    table: list[tuple[str, tuple[int, ...], int]] = []
    offset = 0

    def walk(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise TypeError(
                    f"a {type(obj).__name__} cannot be snapshotted into memory (only plain "
                    "tensors: a model sharded with FSDP is checkpointed to the volume only)"
                )
            index = len(tensors)
            tensors.append(obj.detach())
            table.append((_dtype_name(obj.dtype), tuple(obj.shape), offset))
            offset = _align(offset + obj.numel() * obj.element_size())
            return {_REF: index}
        if _sharded.is_marked(obj):  # its record as it is: one pickled per mesh and shape
            return {**obj, "local": walk(obj["local"])}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    skeleton = walk(state)
    signature = tuple((d, s) for d, s, _ in table)
    return Layout(tensors, table, skeleton, offset, signature)


def skeleton_bytes(layout: Layout) -> bytes:
    """The skeleton region of a snapshot of ``layout``."""
    buf = io.BytesIO()
    torch.save({"table": layout.table, "state": layout.skeleton}, buf)
    return buf.getvalue()


def destinations(buffer: Any, layout: Layout, base: int = 0) -> list[torch.Tensor]:
    """Tensors over ``buffer`` (writable, from ``base``) where ``layout``'s tensors are copied."""
    out = []
    for tensor, (_, shape, offset) in zip(layout.tensors, layout.table, strict=True):
        if tensor.numel() == 0:
            out.append(torch.empty(shape, dtype=tensor.dtype))
            continue
        flat = torch.frombuffer(
            buffer, dtype=tensor.dtype, count=tensor.numel(), offset=base + offset
        )
        out.append(flat.view(shape))
    return out


def step_of(body: Any, data_len: int) -> Any:
    """The step the snapshot in ``body`` holds (its state's ``"step"``; None if it has
    none), read from its skeleton alone: what a slot's header claims is checked
    against it.

    Raises:
        ValueError: The skeleton cannot be read.
    """
    with memoryview(body) as view, view[data_len:] as tail:
        try:
            meta = torch.load(io.BytesIO(tail), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable skeleton is damage
            raise ValueError(f"its skeleton cannot be read ({exc})") from None
    state = meta.get("state") if isinstance(meta, dict) else None
    return state.get("step") if isinstance(state, dict) else None


def decode(body: Any, data_len: int) -> dict[str, Any]:
    """The state a body holds; its tensors share ``body``'s memory (a writable buffer)."""
    view = memoryview(body)
    meta = torch.load(io.BytesIO(view[data_len:]), weights_only=True)
    tensors = []
    for dtype_name, shape, offset in meta["table"]:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a snapshot table names no dtype: {dtype_name!r}")
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            flat = torch.frombuffer(body, dtype=dtype, count=numel, offset=offset)
            # Not a view of ``flat``: a tensor later moved off ``body`` (``Tensor.set_``)
            # keeps no reference to it.
            own = torch.empty(0, dtype=dtype)
            own.set_(flat.untyped_storage(), 0, shape, flat.view(shape).stride())
            tensors.append(own)

    return _fill(meta["state"], tensors)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each placeholder replaced by its tensor. (A function of the module, not
    a closure: a recursive closure is a cycle that would keep the body mapped until a gc.)"""
    if isinstance(obj, dict):
        if len(obj) == 1 and _REF in obj:
            return tensors[obj[_REF]]
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


# --- shares of a node ----------------------------------------------------------

#: Where a slot's skeleton records its share (``base``, ``count``, ``index``, ``digest``).
KEY = "__nbtools_share__"
#: The skeleton's marker of a tensor held in another rank's slot: ``{PEER: rank}``.
PEER = "__nbtools_peer__"
#: The ranks of a node share the replicated tensors of sharded state only when one is this
#: large: below, a restore would map and read every peer's slot for a few bytes (an FSDP2
#: or tensor-parallel state, whose only replicated tensors are the optimizer's step counts).
SHARE_MIN_BYTES = 1024


@dataclass(frozen=True)
class Share:
    """Ranks ``base .. base + count - 1`` split their replicated tensors; this rank is
    the ``index``-th of them."""

    base: int
    count: int
    index: int

    @property
    def ranks(self) -> range:
        """The ranks sharing."""
        return range(self.base, self.base + self.count)


Path = tuple[Any, ...]


def _is_marker(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) == 1 and PEER in obj


def _rebuild(state: dict[str, Any], leaf: Callable[[Any, Path], Any]) -> dict[str, Any]:
    """``state`` with each tensor and marker outside the per-rank part (and the share
    record) replaced by ``leaf(it, path)``, in walk order."""

    return {k: v if k in (_state.NS, KEY) else _walk(v, (k,), leaf) for k, v in state.items()}


def _walk(obj: Any, path: Path, leaf: Callable[[Any, Path], Any]) -> Any:
    """``obj`` rebuilt by :func:`_rebuild`. (A function of the module, not a closure: a
    recursive closure is a cycle that would keep what ``leaf`` holds until a gc.) A
    DTensor's local shard is this rank's own (see ``_sharded``): never shared."""
    if _sharded.is_marked(obj):
        return obj
    if isinstance(obj, torch.Tensor) or _is_marker(obj):
        return leaf(obj, path)
    if isinstance(obj, dict):
        return {k: _walk(v, (*path, k), leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, (*path, i), leaf) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_walk(v, (*path, i), leaf) for i, v in enumerate(obj))
    return obj


def _replicated(state: dict[str, Any]) -> list[tuple[Path, torch.Tensor]]:
    """``(path, tensor)`` of every tensor outside the per-rank part, in walk order."""
    out: list[tuple[Path, torch.Tensor]] = []

    def seen(obj: Any, path: Path) -> Any:
        if isinstance(obj, torch.Tensor):
            out.append((path, obj))
        return obj

    _rebuild(state, seen)
    return out


def _has_shards(obj: Any) -> bool:
    """Whether ``obj`` (nested containers) holds a DTensor's record (see ``_sharded``)."""
    if _sharded.is_marked(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_shards(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_shards(v) for v in obj)
    return False


def worth_sharing(state: dict[str, Any]) -> bool:
    """Whether the ranks of a node share ``state``'s replicated tensors: always for plain
    (data-parallel) state; for sharded state (DTensor local shards, never shared) only
    when some replicated tensor has :data:`SHARE_MIN_BYTES` or more."""
    if not any(_has_shards(v) for k, v in state.items() if k not in (_state.NS, KEY)):
        return True
    return any(t.numel() * t.element_size() >= SHARE_MIN_BYTES for _, t in _replicated(state))


def digest(state: dict[str, Any]) -> str:
    """What the split of ``state`` depends on: its replicated tensors' paths, dtypes, shapes."""
    h = hashlib.sha256()
    for path, tensor in _replicated(state):
        h.update(repr((path, str(tensor.dtype), tuple(tensor.shape))).encode())
    return h.hexdigest()[:32]


def _assign(sizes: list[int], count: int) -> list[int]:
    """The index of the rank that copies each tensor: largest first, to the least loaded
    (ties to the lowest index). The same sizes give the same answer on every rank."""
    loads = [0] * count
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(count), key=lambda j: (loads[j], j))
        owner[i] = j
        loads[j] += sizes[i]
    return owner


def mark(state: dict[str, Any], share: Share) -> dict[str, Any]:
    """``state`` with each replicated tensor of another rank's share replaced by a marker
    naming that rank, and the share recorded under :data:`KEY`."""
    found = _replicated(state)
    owner = _assign([t.numel() * t.element_size() for _, t in found], share.count)
    others = {
        path: share.base + j for (path, _), j in zip(found, owner, strict=True) if j != share.index
    }

    def share_of(obj: Any, path: Path) -> Any:
        rank = others.get(path)
        return obj if rank is None else {PEER: rank}

    out = _rebuild(state, share_of)
    out[KEY] = {
        "base": share.base,
        "count": share.count,
        "index": share.index,
        "digest": digest(state),
    }
    return out


def owners(state: dict[str, Any]) -> set[int]:
    """The ranks whose slots hold tensors that ``state`` (a decoded snapshot) lacks."""
    found: set[int] = set()

    def seen(obj: Any, path: Path) -> Any:
        if _is_marker(obj):
            found.add(int(obj[PEER]))
        return obj

    _rebuild(state, seen)
    return found


def fill(state: dict[str, Any], peers: dict[int, dict[str, Any]], where: str) -> dict[str, Any]:
    """``state`` (decoded, its share recorded) whole: each marker replaced by the tensor at
    the same place in the snapshot of the rank it names (``peers``, decoded, same step).

    Raises:
        CheckpointError: A peer's snapshot is missing, of another layout, or lacks a
            tensor the marker says it holds.
    """
    mine = state.get(KEY)
    for rank, peer in peers.items():
        theirs = peer.get(KEY)
        if mine is None or theirs is None or theirs["digest"] != mine["digest"]:
            raise CheckpointError(
                f"{where} and the snapshot of rank {rank} it shares tensors with hold "
                "different tensors (another model or optimizer layout)"
            )

    def resolve(obj: Any, path: Path) -> Any:
        if not _is_marker(obj):
            return obj
        rank = int(obj[PEER])
        if rank not in peers:
            raise CheckpointError(f"{where} needs the snapshot of rank {rank}; none was read")
        value: Any = peers[rank]
        try:
            for key in path:
                value = value[key]
        except (KeyError, IndexError, TypeError):
            value = None
        if not isinstance(value, torch.Tensor):
            name = ".".join(str(p) for p in path)
            raise CheckpointError(
                f"{where} expects {name} in the snapshot of rank {rank}, which lacks it"
            )
        return value

    out = _rebuild(state, resolve)
    out.pop(KEY, None)
    return out


def decide(rank: int, reports: list[tuple[int, int, str, str]]) -> Share | None:
    """This rank's share, from every rank's ``(base, count, digest, where)`` at the first
    snapshot (``where``: the machine and snapshot directory it sees): the ranks of its
    node share when they all report the same node (``base``, ``count``, ``where``) and the
    same tensors; else (or alone on its node) None."""
    base, count, mark_, where = reports[rank]
    if count < 2 or not 0 <= base <= rank < base + count <= len(reports):
        return None
    if any(reports[r] != (base, count, mark_, where) for r in range(base, base + count)):
        return None
    return Share(base, count, rank - base)


def agree(
    group: Any, rank: int, directory: str | None, state: dict[str, Any]
) -> tuple[Share | None, dict[int, tuple[int, int]]]:
    """This rank's share, and every rank's ``(base, count)``, from what each rank reports
    over ``group`` (a collective; None: a single rank) before its first snapshot of
    ``state``, its slots in ``directory`` (None: it snapshots nothing). A state with no
    replicated tensor worth sharing (:func:`worth_sharing`) is kept whole by each rank."""
    try:  # ranks that share must see each other's slots
        if directory is None:
            raise FileNotFoundError("no snapshots")
        seen = os.stat(directory)
        where = f"{machine_id()}:{seen.st_dev}:{seen.st_ino}"
    except OSError:  # gone (another manager of the job closed): keep whole snapshots
        where = f"rank {rank}"
    base = rank - runtime.get_local_rank()
    count = runtime.get_local_world_size() if worth_sharing(state) else 1
    mine = (base, count, digest(state), where)
    reports = [tuple(r) for r in gather(group, mine)]
    groups = {}
    for other in range(len(reports)):
        share = decide(other, reports)
        groups[other] = (share.base, share.count) if share else (other, 1)
    return decide(rank, reports), groups
