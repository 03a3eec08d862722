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

**CUDA tensors** never block the training thread for their copy (see
:class:`Mirrors`): each is copied, without waiting, into a pinned host mirror of
its own (allocated once per layout: pinned memory the size of the rank's share of
its CUDA state). The parameters and optimizer state go on a side stream that
first waits for the work already queued (the step just taken); the other tensors
(a batch norm's running statistics, which the next forward pass changes) go on
the compute stream, ahead of that forward pass. The next optimizer step waits for
the side stream's copies on the GPU (``wait_event``), never on the host; the
background thread waits for them, then copies and checksums from the mirrors.
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
from nbtools.checkpoint._memory._mappings import Mapped
from nbtools.checkpoint._memory._slots import HEADER_BYTES

__all__ = ["Behind", "Mirrors", "late_tensors", "copy_and_checksum", "stepped", "StepGate"]

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


def stepped(tensors: list[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]) -> list[bool]:
    """For each of a layout's tensors, whether only a step of one of ``optimizers`` changes it."""
    keys = _stepped(optimizers)
    return [t.numel() > 0 and _key(t) in keys for t in tensors]


def late_tensors(
    tensors: list[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]
) -> list[bool]:
    """For each of a layout's tensors, whether it may be copied behind training: a
    contiguous CPU tensor that only a step of one of ``optimizers`` changes."""
    return [
        s and t.device.type == "cpu" and t.is_contiguous()
        for t, s in zip(tensors, stepped(tensors, optimizers), strict=True)
    ]


class Mirrors:
    """One pinned host mirror per CUDA tensor of a layout, allocated once per layout (the
    tier keeps them from one snapshot to the next), and the copies into them.

    Each round reads the mirrors until it ends, and the next snapshot waits for the
    round before it copies into them again.
    """

    def __init__(self) -> None:
        self._signature: tuple[Any, ...] | None = None
        self._hosts: list[torch.Tensor | None] = []
        self._side: dict[torch.device, Any] = {}

    @staticmethod
    def wanted(tensors: list[torch.Tensor]) -> list[bool]:
        """Which of ``tensors`` are copied through a mirror: the CUDA ones, not empty."""
        return [t.device.type == "cuda" and t.numel() > 0 for t in tensors]

    def _mirrors(self, layout: _layout.Layout, cuda: list[bool]) -> list[torch.Tensor | None]:
        if self._signature != layout.signature or len(self._hosts) != len(cuda):
            self._hosts = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if c else None
                for t, c in zip(layout.tensors, cuda, strict=True)
            ]
            self._signature = layout.signature
        return self._hosts

    def _stream(self, device: torch.device) -> Any:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def launch(
        self, layout: _layout.Layout, cuda: list[bool], behind: list[bool]
    ) -> tuple[list[torch.Tensor | None], list[tuple[torch.device, Any]], list[Any]]:
        """Queue the copy of each CUDA tensor into its mirror, without waiting: those
        ``behind`` (only an optimizer step changes them) on a side stream after the work
        queued so far, the others on the compute stream. The mirrors; the side streams'
        events the next optimizer step waits for (on the GPU), with their devices; and
        every event the copies are complete at."""
        hosts = self._mirrors(layout, cuda)
        gates: list[tuple[torch.device, Any]] = []
        done: list[Any] = []
        devices = sorted(
            {t.device for t, c in zip(layout.tensors, cuda, strict=True) if c}, key=str
        )
        with torch.no_grad():
            for device in devices:
                current = torch.cuda.current_stream(device)
                side = self._stream(device)
                side.wait_stream(current)  # after the step just queued
                mine = [
                    (i, t) for i, t in enumerate(layout.tensors) if cuda[i] and t.device == device
                ]
                with torch.cuda.stream(side):
                    for i, tensor in mine:
                        if behind[i]:
                            hosts[i].copy_(tensor, non_blocking=True)  # type: ignore[union-attr]
                            tensor.record_stream(side)
                    on_side = torch.cuda.Event()
                    on_side.record(side)
                with torch.cuda.stream(current):  # ahead of the next forward pass
                    for i, tensor in mine:
                        if not behind[i]:
                            hosts[i].copy_(tensor, non_blocking=True)  # type: ignore[union-attr]
                    on_current = torch.cuda.Event()
                    on_current.record(current)
                gates.append((device, on_side))
                done += [on_side, on_current]
        return hosts, gates, done

    def close(self) -> None:
        """Drop the mirrors (their pinned memory goes back to torch's host cache)."""
        self._hosts, self._signature, self._side = [], None, {}


class Behind:
    """The tensors of one snapshot still to be copied, and their versions when it was taken.

    Args:
        tensors: The layout's tensors.
        late: Which of them the round copies (CPU ones behind training, CUDA ones from
            their mirrors).
        mirrors: For each tensor, the pinned host mirror the round copies it from (None:
            from the tensor itself).
        ready: The CUDA events the mirrors are filled at (the round waits for them).
        gates: The ``(device, event)`` the next optimizer step waits for on the GPU.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        late: list[bool],
        mirrors: list[torch.Tensor | None] | None = None,
        ready: list[Any] | None = None,
        gates: list[tuple[torch.device, Any]] | None = None,
    ) -> None:
        self.tensors = tensors
        self.late = late
        self.mirrors = mirrors or [None] * len(tensors)
        self.ready = ready or []
        self.gates = gates or []
        #: Late tensors read from the tensor itself, on the host, behind training.
        self.host = [lt and m is None for lt, m in zip(late, self.mirrors, strict=True)]
        self.versions = [t._version if h else 0 for t, h in zip(tensors, self.host, strict=True)]
        self.copied = threading.Event()
        if not any(self.host):  # no optimizer step needs to wait on the host
            self.copied.set()

    def source(self, index: int) -> torch.Tensor:
        """What the round copies tensor ``index`` from."""
        mirror = self.mirrors[index]
        return self.tensors[index] if mirror is None else mirror

    def changed(self) -> list[int]:
        """Indexes of the late tensors changed in place since the snapshot was taken."""
        return [
            i
            for i, (t, h, v) in enumerate(zip(self.tensors, self.host, self.versions, strict=True))
            if h and t._version != v
        ]


def copy_and_checksum(mapped: Mapped, layout: _layout.Layout, behind: Behind) -> int:
    """Copy ``behind``'s late tensors into ``mapped``'s tensor region, chunk by chunk, and
    return the CRC-32C of the whole region (the tensors copied earlier are only read)."""
    body = mapped.body.data_ptr() if mapped.data_len else 0
    for event in behind.ready:  # the mirrors are filled (CUDA copies queued at the snapshot)
        event.synchronize()
    crc, done = 0, 0
    with memoryview(mapped.mm) as view:

        def check(start: int, end: int) -> None:
            nonlocal crc
            for at in range(start, end, CHUNK):
                with view[HEADER_BYTES + at : HEADER_BYTES + min(end, at + CHUNK)] as part:
                    crc = _layout.checksum(part, crc)

        for index, (tensor, late, (_, _, offset)) in enumerate(
            zip(layout.tensors, behind.late, layout.table, strict=True)
        ):
            size = tensor.numel() * tensor.element_size()
            check(done, offset)  # alignment padding
            if not late:
                check(offset, offset + size)
            else:
                source = behind.source(index).data_ptr()
                for at in range(0, size, CHUNK):
                    n = min(CHUNK, size - at)
                    ctypes.memmove(body + offset + at, source + at, n)
                    check(offset + at, offset + at + n)
            done = offset + size
        check(done, mapped.data_len)
    return crc


class StepGate:
    """Makes every optimizer step wait for the copy in flight (a global step pre-hook),
    while the gate is open: on the host for a copy behind training, on the GPU (its
    current stream waits for the side stream's event) for a copy into CUDA mirrors. The
    hook holds its owner weakly."""

    def __init__(self) -> None:
        self.pending: threading.Event | None = None
        self.events: list[tuple[torch.device, Any]] = []
        ref = weakref.ref(self)

        def before_step(*_: Any) -> None:
            gate = ref()
            if gate is None:
                return
            pending = gate.pending
            if pending is not None:
                pending.wait()
            events, gate.events = gate.events, []
            for device, event in events:  # once: later steps come after it anyway
                torch.cuda.current_stream(device).wait_event(event)

        # Removed on close, or when the gate is collected (a manager never closed).
        self._remove = weakref.finalize(self, register_optimizer_step_pre_hook(before_step).remove)

    def hold(self, copied: threading.Event) -> None:
        """Steps wait for ``copied`` from now on."""
        self.pending = copied

    def hold_gpu(self, events: list[tuple[torch.device, Any]]) -> None:
        """The next step's work waits on the GPU for ``events`` (``(device, event)``)."""
        self.events = list(events)

    def close(self) -> None:
        """Remove the hook."""
        self.pending = None
        self.events = []
        self._remove()
