"""Where readings come from: the backend protocol and the NVML backend.

NVML (``nvidia-ml-py``, module ``pynvml``) is imported and initialised lazily,
on the first :meth:`NVMLBackend.open`. A machine without the driver, without a
GPU, or with a driver too old for the bindings is a state with a plain
message (:class:`BackendUnavailable`, caught by the sampler), never an
exception in the user's cell. A field a GPU does not support reads as ``None``
and is not asked for again.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

from nbtools._internal.log import get_logger
from nbtools.errors import MonitorError
from nbtools.monitor.readings import GPUReading, local_host

__all__ = ["Backend", "BackendUnavailable", "NVMLBackend"]

_log = get_logger("monitor")


class BackendUnavailable(MonitorError):
    """The GPUs cannot be read; ``str(error)`` says why in plain words."""


@runtime_checkable
class Backend(Protocol):
    """What the sampler needs from a source of GPU readings.

    Attributes:
        key: Identifies the GPUs read; two backends with the same key share one sampler.
        source: Shown next to every figure: ``"NVML"`` or ``"simulated"``.
        host: Host name the samples carry.
    """

    key: str
    source: str
    host: str

    def open(self) -> None:
        """Prepare to read; raise :class:`BackendUnavailable` when the GPUs cannot be read."""

    def read(self, now: float) -> list[GPUReading]:
        """Read every GPU once, in index order (``now`` is the sample time, seconds)."""

    def close(self) -> None:
        """Release what :meth:`open` acquired; safe to call twice."""


# NVML error classes by name, mapped to what a user should be told. Names are
# looked up on the module so that a bindings version lacking one still works.
_OPEN_MESSAGES = {
    "NVMLError_LibraryNotFound": (
        "no NVIDIA driver found (libnvidia-ml is missing): this machine has no NVIDIA GPU "
        "or its driver is not installed"
    ),
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is installed but not loaded (no GPU visible)",
    "NVMLError_FunctionNotFound": (
        "NVML version mismatch: the NVIDIA driver is older than nvidia-ml-py expects; "
        "update the driver or install an older nvidia-ml-py"
    ),
    "NVMLError_NoPermission": "no permission to query the NVIDIA driver",
}
_FIELD_SKIP = ("NVMLError_NotSupported", "NVMLError_NotFound", "NVMLError_NoPermission")
_LOST = ("NVMLError_GpuIsLost", "NVMLError_Uninitialized", "NVMLError_DriverNotLoaded")


def _is(error: BaseException, nvml: Any, names: tuple[str, ...]) -> bool:
    classes = tuple(c for c in (getattr(nvml, n, None) for n in names) if isinstance(c, type))
    return bool(classes) and isinstance(error, classes)


class NVMLBackend:
    """Reads the local NVIDIA GPUs through NVML.

    Args:
        host: Host name the samples carry (default: this machine's name).
        indices: NVML indices of the GPUs to read (default: all).

    Example:
        >>> backend = NVMLBackend()
        >>> backend.available()  # False on a machine without an NVIDIA driver  # doctest: +SKIP
        False
        >>> backend.message  # doctest: +SKIP
        'no NVIDIA driver found (libnvidia-ml is missing): ...'
    """

    source = "NVML"

    def __init__(self, host: str | None = None, indices: list[int] | None = None) -> None:
        self.host = host or local_host()
        self.key = f"nvml:{self.host}:{','.join(map(str, indices)) if indices else 'all'}"
        self.message = ""
        self._indices = list(indices) if indices is not None else None
        self._nvml: Any = None
        self._handles: list[tuple[int, Any, str, str]] = []
        # (gpu index, field) pairs the GPU does not support: never asked again.
        self._unsupported: set[tuple[int, str]] = set()
        self._warned: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Open NVML if needed; True when GPUs can be read, else False with :attr:`message` set."""
        try:
            self.open()
        except BackendUnavailable:
            return False
        return True

    def open(self) -> None:
        """Initialise NVML and find the GPUs (idempotent)."""
        with self._lock:
            if self._nvml is not None:
                return
            try:
                import pynvml
            except ImportError:
                self._fail("nvidia-ml-py is not installed; run: pip install nvidia-ml-py")
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as err:
                for name, text in _OPEN_MESSAGES.items():
                    if _is(err, pynvml, (name,)):
                        self._fail(text)
                self._fail(f"NVML could not start: {err}")
            try:
                handles = self._discover(pynvml)
            except pynvml.NVMLError as err:
                pynvml.nvmlShutdown()
                self._fail(f"NVML could not list the GPUs: {err}")
            except ValueError:
                pynvml.nvmlShutdown()
                raise
            if not handles:
                pynvml.nvmlShutdown()
                self._fail("NVML found no GPU on this machine")
            self._nvml, self._handles, self.message = pynvml, handles, ""

    def _discover(self, nvml: Any) -> list[tuple[int, Any, str, str]]:
        count = nvml.nvmlDeviceGetCount()
        wanted = self._indices if self._indices is not None else range(count)
        out = []
        for index in wanted:
            if not 0 <= index < count:
                raise ValueError(f"GPU index {index} does not exist; this machine has {count} GPUs")
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = self._text(nvml, nvml.nvmlDeviceGetName, handle, f"GPU {index}")
            uuid = self._text(nvml, nvml.nvmlDeviceGetUUID, handle, "")
            out.append((index, handle, name, uuid))
        return out

    @staticmethod
    def _text(nvml: Any, func: Any, handle: Any, default: str) -> str:
        try:
            value = func(handle)
        except nvml.NVMLError:
            return default
        return value.decode() if isinstance(value, bytes) else str(value)

    def _fail(self, message: str) -> None:
        self.message = message
        raise BackendUnavailable(message)

    def read(self, now: float) -> list[GPUReading]:
        """Read every GPU once; unsupported fields are ``None``."""
        nvml = self._nvml
        if nvml is None:
            raise BackendUnavailable(self.message or "NVML is not open; call open() first")
        readings = []
        for index, handle, name, uuid in self._handles:
            get = self._getter(nvml, index, handle)
            memory = get("memory", nvml.nvmlDeviceGetMemoryInfo)
            utilization = get("utilization", nvml.nvmlDeviceGetUtilizationRates)
            power = get("power", nvml.nvmlDeviceGetPowerUsage)
            limit = get("power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit)
            readings.append(
                GPUReading(
                    index=index,
                    name=name,
                    uuid=uuid,
                    utilization=None if utilization is None else float(utilization.gpu),
                    memory_used=None if memory is None else float(memory.used),
                    memory_total=None if memory is None else float(memory.total),
                    temperature=_num(
                        get("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
                    ),
                    power=None if power is None else power / 1000.0,
                    power_limit=None if limit is None else limit / 1000.0,
                    sm_clock=_num(get("sm_clock", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)),
                    throttle_reasons=get("throttle_reasons", _throttle_func(nvml)),
                    ecc_uncorrected=get(
                        "ecc_uncorrected",
                        nvml.nvmlDeviceGetTotalEccErrors,
                        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nvml.NVML_VOLATILE_ECC,
                    ),
                )
            )
        return readings

    def _getter(self, nvml: Any, index: int, handle: Any):
        def get(field: str, func: Any, *args: Any) -> Any:
            if func is None or (index, field) in self._unsupported:
                return None
            try:
                return func(handle, *args)
            except nvml.NVMLError as err:
                if _is(err, nvml, _LOST):
                    raise BackendUnavailable(
                        f"GPU {index} can no longer be read ({err}); the driver may have been "
                        "reset or the GPU has fallen off the bus"
                    ) from err
                if _is(err, nvml, _FIELD_SKIP):
                    self._unsupported.add((index, field))
                elif (index, field) not in self._warned:
                    self._warned.add((index, field))
                    _log.warning("GPU %d: cannot read %s: %s", index, field, err)
                return None

        return get

    def close(self) -> None:
        """Shut NVML down (the next :meth:`open` starts it again)."""
        with self._lock:
            nvml, self._nvml, self._handles = self._nvml, None, []
            if nvml is not None:
                try:
                    nvml.nvmlShutdown()
                except nvml.NVMLError as err:  # shutting down must not raise into close()
                    _log.debug("nvmlShutdown failed: %s", err)


def _throttle_func(nvml: Any) -> Any:
    # Renamed "clocks event reasons" in newer drivers; the old name stays as a fallback.
    return getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )


def _num(value: Any) -> float | None:
    return None if value is None else float(value)
