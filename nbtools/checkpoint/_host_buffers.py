"""A DCP ``AsyncStager`` whose host buffers are allocated once and reused.

``dcp.async_save`` blocks the caller only while :meth:`ReusableStager.stage`
copies the state into these buffers; serialisation and upload run in the
background from the copy. Buffers are pinned when CUDA is available, so the
device-to-host copy runs at full speed, and are reallocated only when the
structure of the state (names, shapes, dtypes) changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from nbtools import _torch_compat

__all__ = ["ReusableStager"]


def _signature(obj: Any, prefix: str = "") -> list[tuple[Any, ...]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, tuple(obj.shape), obj.dtype, type(obj).__name__)]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _signature(v, f"{prefix}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [s for i, v in enumerate(obj) for s in _signature(v, f"{prefix}.{i}")]
    return [(prefix, type(obj).__name__)]


class ReusableStager(AsyncStager):
    """Copies a state dict into cached (pinned on CUDA) CPU buffers and returns the copy."""

    def __init__(self) -> None:
        self._pin = torch.cuda.is_available()
        self._buffers: dict[str, Any] | None = None
        self._sig: list[tuple[Any, ...]] | None = None

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state's values at this moment, in buffers the caller no longer touches."""
        sig = _signature(state_dict)
        if self._buffers is None or sig != self._sig:
            self._buffers = None  # free the old buffers before allocating new ones
            self._buffers = _torch_compat.create_cpu_state_dict(state_dict, pin_memory=self._pin)
            self._sig = sig
        # GPU path: non-blocking device-to-host copies into pinned memory, then one sync.
        staged = _torch_compat.copy_state_dict(state_dict, self._buffers, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        return staged

    @property
    def should_synchronize_after_execute(self) -> bool:
        """DCP need not call :meth:`synchronize_staging`: :meth:`stage` returns a finished copy."""
        return False

    def synchronize_staging(self) -> None:
        """Staging is complete when :meth:`stage` returns; nothing to wait for."""

    def close(self) -> None:
        """Release the buffers."""
        self._buffers = None
        self._sig = None
