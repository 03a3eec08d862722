"""Bounded history of samples, grouped by host, in preallocated ring buffers.

Each host gets a ring of ``capacity`` sample times and, per GPU, a
``capacity x len(FIELDS)`` array of floats (NaN where a field was not
available). Memory is fixed once a host's GPUs are known: it does not grow
with uptime, however long the pane runs.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from nbtools.monitor.readings import FIELDS, Sample
from nbtools.monitor.timing import MAX_HISTORY_POINTS

__all__ = ["History"]

_COLUMNS = ("time", "host", "gpu", "name", *FIELDS)
_INT_FIELDS = {"throttle_reasons", "ecc_uncorrected"}


class _HostRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times = np.full(capacity, np.nan)
        self.values: dict[int, np.ndarray] = {}
        self.names: dict[int, str] = {}
        self.count = 0  # samples ever added; the newest is at (count - 1) % capacity

    def add(self, sample: Sample) -> None:
        slot = self.count % self.capacity
        self.times[slot] = sample.time
        seen = set()
        for reading in sample.gpus:
            ring = self.values.get(reading.index)
            if ring is None:
                ring = self.values[reading.index] = np.full((self.capacity, len(FIELDS)), np.nan)
            self.names[reading.index] = reading.name
            ring[slot] = [_float(getattr(reading, f)) for f in FIELDS]
            seen.add(reading.index)
        for index, ring in self.values.items():
            if index not in seen:  # a GPU missing from this sample has no values for it
                ring[slot] = np.nan
        self.count += 1

    def order(self) -> np.ndarray:
        """Slots from oldest to newest."""
        if self.count <= self.capacity:
            return np.arange(self.count)
        start = self.count % self.capacity
        return np.concatenate([np.arange(start, self.capacity), np.arange(start)])

    def nbytes(self) -> int:
        return self.times.nbytes + sum(v.nbytes for v in self.values.values())


def _float(value: object) -> float:
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


class History:
    """The last ``capacity`` samples of every host.

    Args:
        capacity: Samples kept per host (``ceil(history_seconds / interval) + 1``
            for a sampler), at most ``MAX_HISTORY_POINTS``.

    Example:
        >>> from nbtools.monitor import SimulatedBackend, Sample
        >>> h = History(capacity=3)
        >>> for t in range(5):
        ...     h.add(Sample("node0", float(t), tuple(SimulatedBackend(2).read(t))))
        >>> len(h), h.columns()["time"][:2]
        (3, [2.0, 3.0])
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise TypeError(f"capacity must be an integer number of samples, got {capacity!r}")
        if not 1 <= capacity <= MAX_HISTORY_POINTS:
            raise ValueError(
                f"capacity must be between 1 and {MAX_HISTORY_POINTS} samples, got {capacity}"
            )
        self.capacity = capacity
        self._hosts: dict[str, _HostRing] = {}
        self._lock = threading.Lock()

    def add(self, sample: Sample) -> None:
        """Store a sample, dropping the oldest of its host when full."""
        with self._lock:
            ring = self._hosts.get(sample.host)
            if ring is None:
                ring = self._hosts[sample.host] = _HostRing(self.capacity)
            ring.add(sample)

    def __len__(self) -> int:
        """Number of samples held, all hosts together."""
        with self._lock:
            return sum(min(r.count, r.capacity) for r in self._hosts.values())

    @property
    def nbytes(self) -> int:
        """Bytes held by the ring buffers."""
        with self._lock:
            return sum(r.nbytes() for r in self._hosts.values())

    def hosts(self) -> list[str]:
        """Host names in the order they first reported."""
        with self._lock:
            return list(self._hosts)

    def gpus(self) -> list[tuple[str, int, str]]:
        """``(host, index, name)`` of every GPU seen, grouped by host."""
        with self._lock:
            return [
                (host, index, ring.names[index])
                for host, ring in self._hosts.items()
                for index in sorted(ring.values)
            ]

    def series(self, host: str, index: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        """Times and values of one field of one GPU, oldest first (NaN = not available)."""
        column = FIELDS.index(field)
        with self._lock:
            ring = self._hosts[host]
            order = ring.order()
            values = ring.values.get(index)
            if values is None:
                raise KeyError(f"host {host!r} has no GPU {index}")
            return ring.times[order].copy(), values[order, column].copy()

    def columns(self) -> dict[str, list[Any]]:
        """The whole history in long form: one row per GPU and sample.

        Returns:
            ``{"time", "host", "gpu", "name", *FIELDS}`` to lists of equal length;
            a field that was not available is ``None``.
        """
        out: dict[str, list[Any]] = {name: [] for name in _COLUMNS}
        with self._lock:
            for host, ring in self._hosts.items():
                order = ring.order()
                times = ring.times[order].tolist()
                for index in sorted(ring.values):
                    block = ring.values[index][order]
                    n = len(times)
                    out["time"] += times
                    out["host"] += [host] * n
                    out["gpu"] += [index] * n
                    out["name"] += [ring.names[index]] * n
                    for column, field in enumerate(FIELDS):
                        cast = int if field in _INT_FIELDS else float
                        out[field] += [
                            None if math.isnan(v) else cast(v) for v in block[:, column].tolist()
                        ]
        return out
