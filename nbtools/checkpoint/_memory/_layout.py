"""The bytes of a snapshot: tensors as raw buffers, the rest as a small skeleton.

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
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

__all__ = [
    "Layout",
    "plan",
    "skeleton_bytes",
    "destinations",
    "decode",
    "step_of",
    "checksum",
    "ALIGN",
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
    signature: tuple


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
