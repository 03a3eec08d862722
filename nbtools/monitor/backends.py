"""Where readings come from: the backend protocol and the NVML backend.

NVML (``nvidia-ml-py``, module ``pynvml``) is imported and initialised lazily,
on the first :meth:`NVMLBackend.open`. A machine without the driver, without a
GPU, or with a driver too old for the bindings is a state with a plain
message (:class:`BackendUnavailable`, caught by the sampler), never an
exception in the user's cell. A field a GPU does not support reads as ``None``
and is not asked for again.

A GPU with MIG enabled is read whole (memory, temperature, power) and each of
its MIG devices as a row of its own (:func:`~nbtools.monitor.readings.mig_index`),
whose memory is its own; NVML reports no utilization for either, which the
row says. XID errors (NVML's critical-error events) are read with every poll
and become ``gpu_xid`` events on the run's time axis. A GPU that is lost
(``GPU_IS_LOST``) becomes a ``gpu_lost`` event and a row that says so while
the other GPUs are read on; :meth:`NVMLBackend.open` (what the pane's Refresh
calls) starts NVML again and finds the GPUs anew.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol, runtime_checkable

from nbtools import events as _events
from nbtools._internal.log import get_logger
from nbtools.errors import MonitorError
from nbtools.monitor.readings import GPUReading, local_host, mig_index

__all__ = ["Backend", "BackendUnavailable", "NVMLBackend", "XID_MEANINGS"]

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
_LOST = ("NVMLError_GpuIsLost",)
_DRIVER_GONE = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded")
#: What the commonest XID errors mean (NVIDIA's XID catalogue).
XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
_XID_EVENT = 0x0000000000000008  # nvmlEventTypeXidCriticalError
_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


class _GpuLost(Exception):
    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"GPU {index} can no longer be read ({error})")
        self.index = index


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
        #: GPUs lost since NVML started: index -> why.
        self.lost: dict[int, str] = {}
        self._mig_parents: set[int] = set()
        self._events: Any = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Open NVML if needed; True when GPUs can be read, else False with :attr:`message` set."""
        try:
            self.open()
        except BackendUnavailable:
            return False
        return True

    def open(self) -> None:
        """Initialise NVML and find the GPUs (idempotent while every GPU can be read; after
        a GPU was lost, NVML is shut down and started again, and the GPUs found anew)."""
        if self._nvml is not None and self.lost:
            self.close()
        with self._lock:
            if self._nvml is not None:
                return
            self._mig_parents = set()
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
            self.lost, self._unsupported = {}, set()
            self._watch_xids(pynvml)

    @property
    def _mig_children(self) -> set[int]:
        return {index for index, *_ in self._handles if index >= mig_index(0, 0)}

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
            out += self._mig_devices(nvml, index, handle)
        return out

    def _mig_devices(self, nvml: Any, index: int, handle: Any) -> list[tuple[int, Any, str, str]]:
        """The MIG devices of GPU ``index`` when MIG is enabled on it (else none)."""
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", _MIG_ENABLED):
                return []
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except (AttributeError, nvml.NVMLError):
            return []  # bindings or a GPU without MIG
        self._mig_parents.add(index)
        out = []
        for slot in range(int(slots)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError:
                continue  # an empty slot
            key = mig_index(index, slot)
            name = self._text(nvml, nvml.nvmlDeviceGetName, mig, f"GPU {index} MIG {slot}")
            out.append((key, mig, name, self._text(nvml, nvml.nvmlDeviceGetUUID, mig, "")))
        return out

    def _watch_xids(self, nvml: Any) -> None:
        """Register every whole GPU for XID events (where the driver allows it)."""
        try:
            events = nvml.nvmlEventSetCreate()
        except (AttributeError, nvml.NVMLError) as err:
            _log.debug("XID errors cannot be watched: %s", err)
            return
        watched = 0
        for index, handle, _name, _uuid in self._handles:
            if index in self._mig_children:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(
                    handle, getattr(nvml, "nvmlEventTypeXidCriticalError", _XID_EVENT), events
                )
                watched += 1
            except nvml.NVMLError as err:
                _log.debug("GPU %d: XID errors cannot be watched: %s", index, err)
        if watched:
            self._events = events
        else:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(events)

    def _read_xids(self, nvml: Any) -> None:
        """Turn the XID events NVML queued since the last poll into ``gpu_xid`` events."""
        if self._events is None:
            return
        by_uuid = {uuid: index for index, _h, _n, uuid in self._handles if uuid}
        for _ in range(256):  # a storm of errors is read over several polls
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as err:
                if not _is(err, nvml, ("NVMLError_Timeout",)):
                    _log.debug("reading XID events failed: %s", err)
                return
            uuid = self._text(nvml, nvml.nvmlDeviceGetUUID, data.device, "")
            index = by_uuid.get(uuid, -1)
            xid = int(data.eventData)
            meaning = XID_MEANINGS.get(xid, "see NVIDIA's XID catalogue")
            where = f"GPU {index}" if index >= 0 else "a GPU"
            _events.emit(
                "gpu_xid",
                f"{where} of {self.host}: Xid {xid} ({meaning})",
                gpu=index,
                xid=xid,
                uuid=uuid,
                node=self.host,
            )

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
            if index in self.lost:
                readings.append(GPUReading(index=index, name=name, uuid=uuid, problem="lost"))
                continue
            try:
                readings.append(self._read_one(nvml, index, handle, name, uuid))
            except BackendUnavailable:
                self.close()  # the driver is gone: the next open() starts NVML again
                raise
            except _GpuLost as lost:
                self.lost[index] = str(lost)
                _log.warning("%s", lost)
                _events.emit(
                    "gpu_lost",
                    f"{lost}; the other GPUs are still read; Refresh starts NVML again",
                    gpu=index,
                    uuid=uuid,
                    node=self.host,
                )
                readings.append(GPUReading(index=index, name=name, uuid=uuid, problem="lost"))
        if all(index in self.lost for index, *_ in self._handles):
            message = "; ".join(self.lost.values())
            self.close()
            raise BackendUnavailable(
                f"{message}; the driver may have been reset or the GPU has fallen off the bus"
            )
        self._read_xids(nvml)
        return readings

    def _read_one(self, nvml: Any, index: int, handle: Any, name: str, uuid: str) -> GPUReading:
        get = self._getter(nvml, index, handle)
        memory = get("memory", nvml.nvmlDeviceGetMemoryInfo)
        utilization = get("utilization", nvml.nvmlDeviceGetUtilizationRates)
        power = get("power", nvml.nvmlDeviceGetPowerUsage)
        limit = get("power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit)
        return GPUReading(
            index=index,
            name=name,
            uuid=uuid,
            problem=self._note(index),
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

    def _note(self, index: int) -> str:
        if index in self._mig_parents:
            return "MIG enabled: utilization per MIG device only, which NVML does not report"
        if index in self._mig_children:
            return "MIG device: NVML reports no utilization"
        return ""

    def _getter(self, nvml: Any, index: int, handle: Any):
        def get(field: str, func: Any, *args: Any) -> Any:
            if func is None or (index, field) in self._unsupported:
                return None
            try:
                return func(handle, *args)
            except nvml.NVMLError as err:
                if _is(err, nvml, _LOST):
                    raise _GpuLost(index, err) from err
                if _is(err, nvml, _DRIVER_GONE):
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
            events, self._events = self._events, None
            if nvml is not None and events is not None:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlEventSetFree(events)
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
