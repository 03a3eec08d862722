"""Capturing and restoring the RNG streams of Python, NumPy, torch CPU and every CUDA device.

States are plain Python data and tensors, so they load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """The current state of every RNG stream this process uses."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the streams captured by :func:`capture_rng` (CUDA devices that exist here)."""
    random.setstate(
        tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:])
    )
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        for i, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, i)
