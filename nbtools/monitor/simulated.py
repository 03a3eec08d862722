"""A made-up set of GPUs for demos and tests, always labelled "simulated".

The curves are a deterministic function of time, GPU index and seed: the
same clock gives the same numbers, so tests can use a fake clock.
"""

from __future__ import annotations

import math

from nbtools.monitor.readings import FIELDS, GPUReading

__all__ = ["SimulatedBackend"]

_GIB = 1024**3


class SimulatedBackend:
    """Plausible, deterministic readings for ``num_gpus`` GPUs of one host.

    Args:
        num_gpus: How many GPUs to simulate (at least 1).
        host: Host name the samples carry (default ``"simulated"``); give several
            backends different hosts to mimic a multi-node run.
        memory_gib: Device memory of each GPU.
        power_limit: Power limit of each GPU in watts.
        seed: Shifts the curves, so two backends can differ.
        unsupported: Fields to report as not available (``"power"``,
            ``"ecc_uncorrected"``, ...), as a GPU without those sensors would.
        speed: Simulated seconds per real second; above 1 the curves move
            faster, which makes short demos show more than flat lines.

    Example:
        >>> backend = SimulatedBackend(num_gpus=2)
        >>> [round(r.utilization) for r in backend.read(0.0)]
        [36, 95]
    """

    source = "simulated"

    def __init__(
        self,
        num_gpus: int = 4,
        *,
        host: str = "simulated",
        memory_gib: float = 80.0,
        power_limit: float = 700.0,
        seed: int = 0,
        unsupported: tuple[str, ...] | list[str] = (),
        speed: float = 1.0,
    ) -> None:
        if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
            raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        unknown = set(unsupported) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; choose from {list(FIELDS)}")
        if not (isinstance(speed, (int, float)) and speed > 0):
            raise ValueError(f"speed must be a positive number, got {speed!r}")
        self.num_gpus = num_gpus
        self.speed = float(speed)
        self.host = host
        self.memory_total = memory_gib * _GIB
        self.power_limit = float(power_limit)
        self.seed = seed
        self.unsupported = frozenset(unsupported)
        self.key = f"simulated:{host}:{num_gpus}:{seed}:{speed:g}"
        self.message = ""

    def available(self) -> bool:
        """Always True: simulated GPUs are always there."""
        return True

    def open(self) -> None:
        """Nothing to prepare."""

    def close(self) -> None:
        """Nothing to release."""

    def read(self, now: float) -> list[GPUReading]:
        """Readings of every simulated GPU at time ``now`` (seconds)."""
        return [self._reading(i, now * self.speed) for i in range(self.num_gpus)]

    def _reading(self, index: int, now: float) -> GPUReading:
        phase = 0.9 * index + 0.37 * self.seed
        # A slow training-like wave, a faster wobble and a dip every ~7 minutes (evaluation).
        wave = 0.5 + 0.35 * math.sin(now / 240.0 + phase) + 0.1 * math.sin(now / 17.0 + 2 * phase)
        dip = 0.55 if (now + 40 * index) % 420.0 < 30.0 else 1.0
        util = max(0.0, min(100.0, 100.0 * wave * dip + 8.0))
        memory_share = 0.35 + 0.45 * (0.5 + 0.5 * math.sin(now / 900.0 + phase))
        temperature = 34.0 + 0.42 * util + 3.0 * math.sin(now / 60.0 + phase)
        values = {
            "utilization": round(util, 1),
            "memory_used": float(round(self.memory_total * memory_share, -6)),
            "memory_total": self.memory_total,
            "temperature": round(temperature, 1),
            "power": round(self.power_limit * (0.12 + 0.8 * util / 100.0), 1),
            "power_limit": self.power_limit,
            "sm_clock": float(round(1980.0 - 4.0 * max(0.0, temperature - 75.0))),
            "throttle_reasons": 0x20 if temperature > 80.0 else 0,
            "ecc_uncorrected": 0,
        }
        for name in self.unsupported:
            values[name] = None
        return GPUReading(
            index=index,
            name=f"Simulated GPU {index}",
            uuid=f"GPU-simulated-{self.seed}-{index}",
            **values,
        )
