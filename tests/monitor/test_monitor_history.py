"""History ring buffers and the simulated backend."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from nbtools.monitor import FIELDS, GPUReading, History, Sample, SimulatedBackend, describe_throttle


def sample(host: str, t: float, n: int = 2, **fields) -> Sample:
    return Sample(host, t, tuple(GPUReading(i, f"G{i}", **fields) for i in range(n)))


def test_keeps_the_newest_samples_in_order():
    history = History(capacity=4)
    for t in range(10):
        history.add(sample("a", float(t), utilization=float(t)))
    times, values = history.series("a", 1, "utilization")
    assert times.tolist() == [6.0, 7.0, 8.0, 9.0]
    assert values.tolist() == [6.0, 7.0, 8.0, 9.0]
    assert len(history) == 4


def test_columns_are_long_form_with_none_for_not_available():
    history = History(capacity=3)
    history.add(sample("a", 1.0, utilization=10.0, throttle_reasons=4))
    history.add(sample("b", 2.0, n=1, power=250.0))
    cols = history.columns()
    assert set(cols) == {"time", "host", "gpu", "name", *FIELDS}
    assert cols["host"] == ["a", "a", "b"] and cols["gpu"] == [0, 1, 0]
    assert cols["utilization"] == [10.0, 10.0, None]
    assert cols["power"] == [None, None, 250.0]
    assert cols["throttle_reasons"] == [4, 4, None] and isinstance(cols["throttle_reasons"][0], int)


def test_a_gpu_missing_from_a_sample_has_no_values_then():
    history = History(capacity=3)
    history.add(sample("a", 1.0, n=2, utilization=5.0))
    history.add(sample("a", 2.0, n=1, utilization=6.0))
    _, values = history.series("a", 1, "utilization")
    assert values[0] == 5.0 and math.isnan(values[1])
    with pytest.raises(KeyError, match="no GPU 7"):
        history.series("a", 7, "utilization")


def test_memory_is_fixed_once_the_gpus_are_known():
    history = History(capacity=720)
    history.add(sample("a", 0.0, n=8))
    size = history.nbytes
    for t in range(1, 3000):
        history.add(sample("a", float(t), n=8))
    assert history.nbytes == size == 720 * 8 + 8 * 720 * len(FIELDS) * 8


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity must be between 1 and"):
        History(0)


def test_simulated_backend_is_deterministic_plausible_and_labelled():
    a, b = SimulatedBackend(4), SimulatedBackend(4)
    assert a.read(1234.5) == b.read(1234.5)
    assert a.read(1234.5) != a.read(1300.0)
    assert a.source == "simulated" and a.available()
    for t in range(0, 7200, 97):
        for r in a.read(float(t)):
            assert 0 <= r.utilization <= 100
            assert 0 < r.memory_used < r.memory_total
            assert 20 < r.temperature < 95 and 0 < r.power <= r.power_limit
            assert r.name.startswith("Simulated GPU")
    assert SimulatedBackend(2, seed=1).read(5.0) != SimulatedBackend(2, seed=0).read(5.0)
    partial = SimulatedBackend(1, unsupported=["power", "ecc_uncorrected"]).read(0.0)[0]
    assert partial.power is None and partial.ecc_uncorrected is None and partial.utilization


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_gpus": 0}, "num_gpus must be a positive integer"),
        ({"unsupported": ["fan"]}, "unknown fields"),
        ({"speed": 0}, "speed must be a positive"),
    ],
)
def test_simulated_backend_validates(options, match):
    with pytest.raises(ValueError, match=match):
        SimulatedBackend(**options)


def test_throttle_reasons_in_words():
    assert describe_throttle(None) == [] and describe_throttle(0) == []
    assert describe_throttle(0x41) == ["idle", "hardware thermal slowdown"]
    assert describe_throttle(0x10000) == ["other (0x10000)"]


def test_importing_the_monitor_loads_no_front_end():
    code = (
        "import sys, nbtools.monitor as m; m.Sampler; m.NVMLBackend;"
        "bad = [k for k in ('ipywidgets', 'plotly', 'IPython', 'anywidget', 'mlflow', 'torch')"
        " if k in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
