"""Snapshot copies that run behind training until the next optimizer step.

A model's parameters and its optimizer's state change only when the optimizer
steps. So a snapshot copies the rest of its state at once (buffers such as a
batch norm's running statistics, which a forward pass changes, and the small
tensors of other objects), and the parameters and optimizer state on the
tier's background thread while the next forward and backward passes run:
training waits for that copy only when an optimizer is about to step (a global
step pre-hook), as torchtitan's staging waits only before the next step.

The copy is fused with the slot's checksum: each chunk of a tensor is copied
into the slot and checksummed while it is still in the cache, so the state
crosses memory once and no later pass reads the slot again.

A tensor copied behind that changes in place before its copy is complete (a
forward pass that writes into a parameter, an optimizer that is not a
``torch.optim.Optimizer`` and so does not wait) is seen by its version counter:
that snapshot is not published (the previous one stays), and the tier copies
everything at once from then on, with one warning.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nbtools.checkpoint._memory import _layout
from nbtools.checkpoint._memory._slots import HEADER_BYTES, Mapped

__all__ = ["Behind", "late_tensors", "copy_and_checksum", "StepGate"]

#: Bytes copied, then checksummed, at a time (stays in the core's cache in between).
CHUNK = 1 << 20


def _key(tensor: torch.Tensor) -> tuple[int, int, torch.dtype]:
    if isinstance(tensor, DTensor):  # a snapshot holds its local shard (see ``_sharded``)
        tensor = tensor._local_tensor
    return tensor.data_ptr(), tensor.numel(), tensor.dtype


def _stepped(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple[int, int, torch.dtype]]:
    """The tensors only an optimizer step changes: the parameters it updates and its state."""
    keys: set[tuple[int, int, torch.dtype]] = set()
    for optim in optimizers:
        for group in optim.param_groups:
            keys.update(_key(p) for p in group["params"])
        for state in optim.state.values():
            if isinstance(state, dict):
                keys.update(_key(t) for t in state.values() if isinstance(t, torch.Tensor))
    return keys


def late_tensors(
    tensors: list[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]
) -> list[bool]:
    """For each of a layout's tensors, whether it may be copied behind training: a
    contiguous CPU tensor that only a step of one of ``optimizers`` changes."""
    stepped = _stepped(optimizers)
    return [
        t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0 and _key(t) in stepped
        for t in tensors
    ]


class Behind:
    """The tensors of one snapshot still to be copied, and their versions when it was taken."""

    def __init__(self, tensors: list[torch.Tensor], late: list[bool]) -> None:
        self.tensors = tensors
        self.late = late
        self.versions = [t._version if lt else 0 for t, lt in zip(tensors, late, strict=True)]
        self.copied = threading.Event()
        if not any(late):
            self.copied.set()

    def changed(self) -> list[int]:
        """Indexes of the late tensors changed in place since the snapshot was taken."""
        return [
            i
            for i, (t, lt, v) in enumerate(zip(self.tensors, self.late, self.versions, strict=True))
            if lt and t._version != v
        ]


def copy_and_checksum(mapped: Mapped, layout: _layout.Layout, behind: Behind) -> int:
    """Copy ``behind``'s late tensors into ``mapped``'s tensor region, chunk by chunk, and
    return the CRC-32C of the whole region (the tensors copied earlier are only read)."""
    body = mapped.body.data_ptr() if mapped.data_len else 0
    crc, done = 0, 0
    with memoryview(mapped.mm) as view:

        def check(start: int, end: int) -> None:
            nonlocal crc
            for at in range(start, end, CHUNK):
                with view[HEADER_BYTES + at : HEADER_BYTES + min(end, at + CHUNK)] as part:
                    crc = _layout.checksum(part, crc)

        for tensor, late, (_, _, offset) in zip(
            layout.tensors, behind.late, layout.table, strict=True
        ):
            size = tensor.numel() * tensor.element_size()
            check(done, offset)  # alignment padding
            if not late:
                check(offset, offset + size)
            else:
                source = tensor.data_ptr()
                for at in range(0, size, CHUNK):
                    n = min(CHUNK, size - at)
                    ctypes.memmove(body + offset + at, source + at, n)
                    check(offset + at, offset + at + n)
            done = offset + size
        check(done, mapped.data_len)
    return crc


class StepGate:
    """Makes every optimizer step wait for the copy in flight (a global step pre-hook),
    while the gate is open; the hook holds its owner weakly."""

    def __init__(self) -> None:
        self.pending: threading.Event | None = None
        ref = weakref.ref(self)

        def before_step(*_: Any) -> None:
            gate = ref()
            pending = gate.pending if gate is not None else None
            if pending is not None:
                pending.wait()

        # Removed on close, or when the gate is collected (a manager never closed).
        self._remove = weakref.finalize(self, register_optimizer_step_pre_hook(before_step).remove)

    def hold(self, copied: threading.Event) -> None:
        """Steps wait for ``copied`` from now on."""
        self.pending = copied

    def close(self) -> None:
        """Remove the hook."""
        self.pending = None
        self._remove()
