"""Stand-ins at the hardware and front-end boundaries: a fake ``pynvml`` and a recording comm."""

from __future__ import annotations

import itertools
import json
import types
from collections import namedtuple

# --- stand-in pynvml -----------------------------------------------------------

_Memory = namedtuple("_Memory", "total free used")
_Util = namedtuple("_Util", "gpu memory")


class FakeGPU:
    """What the stand-in driver reports for one GPU; a value that is an exception is raised."""

    def __init__(self, index: int, **fields: object) -> None:
        self.index = index
        self.fields = {
            "name": f"NVIDIA Fake {index}",
            "uuid": f"GPU-fake-{index}",
            "memory": _Memory(total=80 * 1024**3, free=60 * 1024**3, used=20 * 1024**3),
            "utilization": _Util(gpu=50 + index, memory=10),
            "temperature": 40 + index,
            "power": 300_000,  # mW
            "power_limit": 700_000,
            "sm_clock": 1980,
            "throttle": 0x1,
            "ecc": 0,
        }
        self.fields.update(fields)
        self.calls: dict[str, int] = {}
        #: MIG devices by slot (None: an empty slot) when MIG is enabled; None: MIG off.
        self.mig: list[FakeGPU | None] | None = None


class NVMLError(Exception):
    """Base of the stand-in's errors, like ``pynvml.NVMLError``."""

    def __init__(self, value: int = 999) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value} ({type(self).__name__})"


#: The stand-in's error classes by pynvml name (shared by every installed stand-in).
ERRORS: dict[str, type[NVMLError]] = {
    f"NVMLError_{name}": type(f"NVMLError_{name}", (NVMLError,), {})
    for name in (
        "NotSupported",
        "NoPermission",
        "GpuIsLost",
        "LibraryNotFound",
        "DriverNotLoaded",
        "FunctionNotFound",
        "Uninitialized",
        "Unknown",
        "NotFound",
        "Timeout",
    )
}


def make_fake_pynvml(gpus: list[FakeGPU], init_error: str | None = None) -> types.ModuleType:
    """A module with pynvml's names, error classes and the calls NVMLBackend makes."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    for name, cls in ERRORS.items():
        setattr(nvml, name, cls)
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.NVML_CLOCK_SM = 1
    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    nvml.NVML_VOLATILE_ECC = 0
    nvml.state = {"initialised": 0, "shutdowns": 0, "xids": [], "event_sets": 0, "freed": 0}
    nvml.NVML_DEVICE_MIG_ENABLE = 1
    nvml.nvmlEventTypeXidCriticalError = 8

    def nvmlInit() -> None:
        if init_error:
            raise getattr(nvml, init_error)()
        nvml.state["initialised"] += 1

    def nvmlShutdown() -> None:
        nvml.state["shutdowns"] += 1

    def value(field: str):
        def call(handle: FakeGPU, *args: object):
            handle.calls[field] = handle.calls.get(field, 0) + 1
            result = handle.fields[field]
            if isinstance(result, type) and issubclass(result, Exception):
                raise result()
            if isinstance(result, Exception):
                raise result
            return result

        return call

    nvml.nvmlInit, nvml.nvmlShutdown = nvmlInit, nvmlShutdown
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    nvml.nvmlDeviceGetName = value("name")
    nvml.nvmlDeviceGetUUID = value("uuid")
    nvml.nvmlDeviceGetMemoryInfo = value("memory")
    nvml.nvmlDeviceGetUtilizationRates = value("utilization")
    nvml.nvmlDeviceGetTemperature = value("temperature")
    nvml.nvmlDeviceGetPowerUsage = value("power")
    nvml.nvmlDeviceGetEnforcedPowerLimit = value("power_limit")
    nvml.nvmlDeviceGetClockInfo = value("sm_clock")
    nvml.nvmlDeviceGetCurrentClocksEventReasons = value("throttle")
    nvml.nvmlDeviceGetTotalEccErrors = value("ecc")

    def mig_mode(handle: FakeGPU) -> tuple[int, int]:
        if handle.mig is None:
            raise ERRORS["NVMLError_NotSupported"]()
        return (1, 1)

    def mig_device(handle: FakeGPU, slot: int) -> FakeGPU:
        found = (handle.mig or [])[slot] if slot < len(handle.mig or []) else None
        if found is None:
            raise ERRORS["NVMLError_NotFound"]()
        return found

    class EventSet:
        def __init__(self) -> None:
            self.devices: list[FakeGPU] = []

    def event_set_create() -> EventSet:
        nvml.state["event_sets"] += 1
        return EventSet()

    def register(handle: FakeGPU, kind: int, events: EventSet) -> None:
        assert kind == 8  # XID critical errors
        events.devices.append(handle)

    def wait(events: EventSet, timeout_ms: int) -> types.SimpleNamespace:
        # state["xids"]: (gpu, xid) that the driver queued since the last read
        for i, (gpu, xid) in enumerate(nvml.state["xids"]):
            if gpu in events.devices:
                del nvml.state["xids"][i]
                return types.SimpleNamespace(device=gpu, eventType=8, eventData=xid)
        raise ERRORS["NVMLError_Timeout"]()

    def free(events: EventSet) -> None:
        nvml.state["freed"] += 1

    nvml.nvmlDeviceGetMigMode = mig_mode
    nvml.nvmlDeviceGetMaxMigDeviceCount = lambda handle: len(handle.mig or [])
    nvml.nvmlDeviceGetMigDeviceHandleByIndex = mig_device
    nvml.nvmlEventSetCreate = event_set_create
    nvml.nvmlDeviceRegisterEvents = register
    nvml.nvmlEventSetWait_v2 = wait
    nvml.nvmlEventSetFree = free
    return nvml


# --- recording comm (the ipywidgets testing approach) ------------------------------

_ids = itertools.count()


class RecordingComm:
    """Stands in for the kernel comm: records what would travel to the front end."""

    kernel = "Truthy"

    def __init__(self, **kwargs: object) -> None:
        self.comm_id = kwargs.get("comm_id") or f"comm-{next(_ids)}"
        self.opened = kwargs.get("data")
        self.opened_buffers = list(kwargs.get("buffers") or [])
        self.sent: list[dict] = []
        self.handler = None
        self.closed = False

    def open(self, *args: object, **kwargs: object) -> None:
        pass

    def on_msg(self, handler) -> None:
        self.handler = handler

    def send(self, data=None, metadata=None, buffers=None) -> None:
        self.sent.append({"data": data, "buffers": buffers or []})

    def close(self, *args: object, **kwargs: object) -> None:
        self.closed = True

    def from_front_end(self, data: dict) -> None:
        """Deliver a message as the front end would."""
        self.handler({"content": {"data": data}, "buffers": []})

    def custom_messages(self) -> list[dict]:
        return [m["data"]["content"] for m in self.sent if m["data"].get("method") == "custom"]

    def opened_state(self) -> dict:
        """The state of the opening message with its binary buffers put back in place."""
        return with_buffers(
            self.opened["state"], self.opened.get("buffer_paths", []), self.opened_buffers
        )

    def open_bytes(self) -> int:
        """Bytes of the opening message on the wire."""
        return message_bytes({"data": self.opened, "buffers": self.opened_buffers})


def with_buffers(state: dict, paths: list, buffers: list) -> dict:
    """``state`` with each buffer (as bytes) at its path, as the front end rebuilds it."""
    state = json.loads(json.dumps(state))
    for path, buffer in zip(paths, buffers, strict=True):
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bytes(buffer)
    return state


def message_bytes(message: dict) -> int:
    """Bytes of one comm message on the wire: its JSON plus binary buffers."""
    return len(json.dumps(message["data"], separators=(",", ":"), default=str)) + sum(
        len(memoryview(b).cast("B")) for b in message["buffers"]
    )
