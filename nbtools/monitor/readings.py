"""What one poll of the GPUs produces: a :class:`Sample` of :class:`GPUReading` values.

A field that a GPU does not report (no power sensor, no ECC memory, a query
the driver does not support) is ``None``: "not available", never an error.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

__all__ = [
    "GPUReading",
    "Sample",
    "FIELDS",
    "THROTTLE_REASONS",
    "describe_throttle",
    "local_host",
    "mig_index",
    "MIG_BASE",
]

#: Numeric fields of a reading, in the order the history stores them.
FIELDS: tuple[str, ...] = (
    "utilization",
    "memory_used",
    "memory_total",
    "temperature",
    "power",
    "power_limit",
    "sm_clock",
    "throttle_reasons",
    "ecc_uncorrected",
)

#: NVML clock-event (throttle) reason bits and their names.
THROTTLE_REASONS: dict[int, str] = {
    0x0001: "idle",
    0x0002: "applications clocks setting",
    0x0004: "software power cap",
    0x0008: "hardware slowdown",
    0x0010: "sync boost",
    0x0020: "software thermal slowdown",
    0x0040: "hardware thermal slowdown",
    0x0080: "hardware power brake",
    0x0100: "display clocks setting",
}


def describe_throttle(mask: int | None) -> list[str]:
    """Names of the reasons set in an NVML clock-event bit mask (``[]`` when none or unknown)."""
    if not mask:
        return []
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    if unknown:
        names.append(f"other (0x{unknown:x})")
    return names


#: MIG device ``slot`` of GPU ``g`` is row ``MIG_BASE * (g + 1) + slot`` (whole GPUs are their
#: NVML index), so its history and its row never mix with a whole GPU's.
MIG_BASE = 1000


def mig_index(gpu: int, slot: int) -> int:
    """The row index of MIG device ``slot`` of the GPU at NVML index ``gpu``."""
    return MIG_BASE * (gpu + 1) + slot


def local_host() -> str:
    """The name this machine's samples carry."""
    return socket.gethostname() or "localhost"


@dataclass(frozen=True, slots=True)
class GPUReading:
    """One GPU at one instant.

    Attributes:
        index: NVML index of the GPU on its host (a MIG device's: :func:`mig_index`).
        name: Product name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        uuid: Stable identifier of the GPU (``""`` when unknown).
        utilization: Percent of time a kernel was running, 0-100.
        memory_used: Bytes of device memory in use.
        memory_total: Bytes of device memory.
        temperature: Core temperature in degrees Celsius.
        power: Power draw in watts.
        power_limit: Enforced power limit in watts.
        sm_clock: Streaming-multiprocessor clock in MHz.
        throttle_reasons: NVML clock-event reason bit mask (see :func:`describe_throttle`).
        ecc_uncorrected: Volatile uncorrected ECC error count since the driver loaded.
        problem: Why values are missing, in words (``"lost"`` for a GPU that fell
            off the bus, a note for MIG); ``""`` when none.
    """

    index: int
    name: str
    uuid: str = ""
    utilization: float | None = None
    memory_used: float | None = None
    memory_total: float | None = None
    temperature: float | None = None
    power: float | None = None
    power_limit: float | None = None
    sm_clock: float | None = None
    throttle_reasons: int | None = None
    ecc_uncorrected: int | None = None
    problem: str = ""


@dataclass(frozen=True, slots=True)
class Sample:
    """All GPUs of one host, read in one pass.

    Attributes:
        host: Name of the machine the GPUs are in; the history and the pane group by it.
        time: Seconds since the epoch when the GPUs were read.
        gpus: One reading per GPU, in index order.
        source: Where the numbers come from (``"NVML"`` or ``"simulated"``).
    """

    host: str
    time: float
    gpus: tuple[GPUReading, ...] = field(default_factory=tuple)
    source: str = "NVML"

    @property
    def simulated(self) -> bool:
        """True when the numbers are made up by :class:`SimulatedBackend`."""
        return self.source == "simulated"
