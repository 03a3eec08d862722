"""NVMLBackend's own code against a stand-in ``pynvml`` (the hardware boundary)."""

from __future__ import annotations

import sys
import time

import pytest
from _monitor_fakes import ERRORS, FakeGPU, _Memory

from nbtools import events
from nbtools.monitor import BackendUnavailable, NVMLBackend, Sampler
from nbtools.monitor.readings import mig_index
from nbtools.monitor.snapshot import gpu_label
from nbtools.monitor.timeline import encode, same_device


def test_reads_several_gpus_in_one_pass(fake_pynvml):
    nvml = fake_pynvml([FakeGPU(0), FakeGPU(1, throttle=0x41, ecc=3), FakeGPU(2)])
    backend = NVMLBackend(host="node7")
    assert backend.available() and backend.message == ""
    readings = backend.read(0.0)
    assert [r.index for r in readings] == [0, 1, 2]
    first, second = readings[0], readings[1]
    assert first.name == "NVIDIA Fake 0" and first.uuid == "GPU-fake-0"
    assert first.utilization == 50.0 and first.temperature == 40.0
    assert first.memory_used == 20 * 1024**3 and first.memory_total == 80 * 1024**3
    assert first.power == 300.0 and first.power_limit == 700.0  # milliwatts to watts
    assert first.sm_clock == 1980.0
    assert second.throttle_reasons == 0x41 and second.ecc_uncorrected == 3
    backend.open()  # idempotent
    assert nvml.state["initialised"] == 1
    backend.close()
    backend.close()
    assert nvml.state["shutdowns"] == 1


def test_unsupported_fields_are_not_available_and_not_asked_again(fake_pynvml):
    unsupported = ERRORS["NVMLError_NotSupported"]
    gpu = FakeGPU(0, power=unsupported, ecc=unsupported, throttle=unsupported, uuid=unsupported)
    fake_pynvml([gpu])
    backend = NVMLBackend()
    backend.open()
    for _ in range(3):
        reading = backend.read(0.0)[0]
    assert reading.power is None and reading.ecc_uncorrected is None
    assert reading.throttle_reasons is None and reading.uuid == ""
    assert reading.utilization == 50.0 and reading.power_limit == 700.0
    assert gpu.calls["power"] == 1 and gpu.calls["ecc"] == 1
    backend.close()


def test_a_failing_field_is_logged_once_and_reads_as_none(fake_pynvml, caplog):
    gpu = FakeGPU(0, temperature=ERRORS["NVMLError_Unknown"])
    fake_pynvml([gpu])
    backend = NVMLBackend()
    backend.open()
    assert backend.read(0.0)[0].temperature is None
    assert backend.read(1.0)[0].temperature is None
    assert gpu.calls["temperature"] == 2  # an unknown error may be transient: asked again
    warnings = [r for r in caplog.records if "cannot read temperature" in r.getMessage()]
    assert len(warnings) == 1
    backend.close()


def test_a_lost_gpu_makes_the_sampler_unavailable(fake_pynvml, clock):
    gpu = FakeGPU(0)
    fake_pynvml([gpu])
    sampler = Sampler(NVMLBackend(), clock=clock, start=False)
    try:
        assert sampler.refresh() is not None
        gpu.fields["utilization"] = ERRORS["NVMLError_GpuIsLost"]
        assert sampler.refresh() is None
        assert sampler.status == "unavailable"
        assert "GPU 0 can no longer be read" in sampler.message
    finally:
        sampler.close()


@pytest.mark.parametrize(
    ("error", "words"),
    [
        ("NVMLError_LibraryNotFound", "no NVIDIA driver found"),
        ("NVMLError_DriverNotLoaded", "driver is installed but not loaded"),
        ("NVMLError_FunctionNotFound", "version mismatch"),
        ("NVMLError_Unknown", "NVML could not start"),
    ],
)
def test_no_driver_is_a_plain_message(fake_pynvml, error, words):
    fake_pynvml([FakeGPU(0)], init_error=error)
    backend = NVMLBackend()
    assert backend.available() is False
    assert words in backend.message
    with pytest.raises(BackendUnavailable, match=words):
        backend.open()


def test_no_gpu_and_no_bindings(fake_pynvml, monkeypatch):
    nvml = fake_pynvml([])
    backend = NVMLBackend()
    assert not backend.available() and backend.message == "NVML found no GPU on this machine"
    assert nvml.state["shutdowns"] == 1  # what was initialised is shut down again
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    backend = NVMLBackend()
    assert not backend.available() and "pip install nvidia-ml-py" in backend.message


def test_a_missing_index_is_a_clear_error(fake_pynvml):
    fake_pynvml([FakeGPU(0)])
    with pytest.raises(ValueError, match="GPU index 3 does not exist; this machine has 1 GPUs"):
        NVMLBackend(indices=[3]).open()


def test_real_nvml_without_a_driver_is_unavailable():
    backend = NVMLBackend()
    if backend.available():
        backend.close()
        pytest.skip("this machine has a working NVIDIA driver")
    assert backend.message and "Traceback" not in backend.message


@pytest.mark.gpu
def test_real_nvml_reads_every_gpu():
    backend = NVMLBackend()
    if not backend.available():
        pytest.skip(f"needs an NVIDIA GPU: {backend.message}")
    try:
        readings = backend.read(0.0)
        assert readings and all(r.memory_total and r.memory_total > 0 for r in readings)
        assert all(r.utilization is not None and 0 <= r.utilization <= 100 for r in readings)
    finally:
        backend.close()


def _logged(kind: str, since: float) -> list:
    return events.log(since=since, kinds=[kind])


def test_mig_devices_are_rows_of_their_own(fake_pynvml):
    unsupported = ERRORS["NVMLError_NotSupported"]
    whole = FakeGPU(1, utilization=unsupported)
    slice_memory = _Memory(total=10 * 1024**3, free=6 * 1024**3, used=4 * 1024**3)
    whole.mig = [
        FakeGPU(
            0, name="MIG 1g.10gb", uuid="MIG-aaa", utilization=unsupported, memory=slice_memory
        ),
        None,  # an empty slot
        FakeGPU(2, name="MIG 2g.20gb", uuid="MIG-bbb", utilization=unsupported),
    ]
    fake_pynvml([FakeGPU(0), whole])
    backend = NVMLBackend()
    backend.open()
    readings = backend.read(0.0)
    assert [r.index for r in readings] == [0, 1, mig_index(1, 0), mig_index(1, 2)]
    assert [gpu_label(r.index) for r in readings] == [
        "GPU 0",
        "GPU 1",
        "GPU 1 · MIG 0",
        "GPU 1 · MIG 2",
    ]
    plain, card, first, _ = readings
    assert plain.problem == "" and plain.utilization == 50.0
    assert card.utilization is None and "MIG enabled" in card.problem
    assert first.uuid == "MIG-aaa" and first.memory_total == 10 * 1024**3
    assert first.utilization is None and "MIG device" in first.problem
    backend.close()


def test_xid_errors_become_failures_on_the_time_axis(fake_pynvml, clock):
    gpus = [FakeGPU(0), FakeGPU(1)]
    nvml = fake_pynvml(gpus)
    since = time.time()
    sampler = Sampler(NVMLBackend(host="node7"), clock=clock, start=False)
    try:
        assert _logged("gpu_xid", since) == []
        nvml.state["xids"] += [(gpus[1], 79), (gpus[0], 31)]
        sampler.refresh()
        got = _logged("gpu_xid", since)
        assert [(e.fields["gpu"], e.fields["xid"]) for e in got] == [(1, 79), (0, 31)]
        assert "GPU 1 of node7: Xid 79 (GPU has fallen off the bus)" == got[0].message
        assert encode(got[0])[2] == "failure"  # a red line across the panels
        sampler.refresh()
        assert len(_logged("gpu_xid", since)) == 2  # each error once
    finally:
        sampler.close()
    assert nvml.state["freed"] == nvml.state["event_sets"] == 1


def test_a_lost_gpu_leaves_the_others_polled_and_refresh_starts_nvml_again(fake_pynvml, clock):
    gpus = [FakeGPU(0), FakeGPU(1)]
    nvml = fake_pynvml(gpus)
    since = time.time()
    sampler = Sampler(NVMLBackend(), clock=clock, start=False)
    try:
        gpus[1].fields["memory"] = ERRORS["NVMLError_GpuIsLost"]
        for _ in range(3):
            clock.advance(sampler.interval)
            sampler.tick()
        assert sampler.status == "polling"
        alive, lost = sampler.last_sample.gpus
        assert alive.utilization == 50.0 and alive.problem == ""
        assert lost.problem == "lost" and lost.utilization is None
        (event,) = _logged("gpu_lost", since)  # said once
        assert event.fields["gpu"] == 1 and encode(event)[2] == "failure"
        assert nvml.state["initialised"] == 1  # polling does not restart NVML
        gpus[1].fields["memory"] = FakeGPU(1).fields["memory"]  # the GPU is back (reset)
        sample = sampler.refresh()
        assert nvml.state["initialised"] == 2 and nvml.state["shutdowns"] == 1
        assert [r.problem for r in sample.gpus] == ["", ""]
        assert sample.gpus[1].memory_used == 20 * 1024**3
    finally:
        sampler.close()


def test_refresh_starts_nvml_again_after_the_driver_went_away(fake_pynvml, clock):
    gpu = FakeGPU(0)
    nvml = fake_pynvml([gpu])
    sampler = Sampler(NVMLBackend(), clock=clock, start=False)
    try:
        gpu.fields["utilization"] = ERRORS["NVMLError_Uninitialized"]
        assert sampler.refresh() is None and sampler.status == "unavailable"
        gpu.fields["utilization"] = FakeGPU(0).fields["utilization"]
        assert sampler.refresh() is not None and sampler.status == "polling"
        assert nvml.state["initialised"] == 2
    finally:
        sampler.close()


def test_nvml_and_cuda_uuids_name_one_device():
    assert same_device(
        "GPU-5b1f0c9e-aaaa-bbbb-cccc-0123456789ab", "5b1f0c9e-aaaa-bbbb-cccc-0123456789ab"
    )
    assert same_device(
        "MIG-11112222-aaaa-bbbb-cccc-0123456789ab", "MIG-11112222-aaaa-bbbb-cccc-0123456789ab"
    )
    assert not same_device("GPU-5b1f0c9e-aaaa-bbbb-cccc-0123456789ab", "GPU-00000000-aaaa")
    assert not same_device("", "")
