"""GPU monitor samples logged as MLflow system metrics, with the monitor's simulated GPUs."""

from __future__ import annotations

import pytest

from nbtools.tracking import MlflowLogger, SystemMetricsSink

monitor = pytest.importorskip("nbtools.monitor")
if not hasattr(monitor, "Sampler"):  # pragma: no cover - monitor package not there yet
    pytest.skip("nbtools.monitor has no Sampler yet", allow_module_level=True)


@pytest.mark.slow
def test_each_poll_becomes_one_step_of_mlflow_system_metrics(client):
    clock = iter(range(1000, 2000, 10))
    local = monitor.SimulatedBackend(2, host="here", unsupported=("power",))
    remote = monitor.SimulatedBackend(1, host="node-b", seed=1)
    sampler = monitor.Sampler(local, interval=10, start=False, clock=lambda: float(next(clock)))
    try:
        with MlflowLogger("exp-system") as run:
            sampler.add_sink(SystemMetricsSink(run, local_host="here"))
            first = sampler.refresh()
            sampler.refresh()
            sampler.ingest(
                monitor.Sample(host="node-b", time=1234.5, gpus=tuple(remote.read(1234.5)))
            )
    finally:
        sampler.close()
    metrics = client.get_run(run.run_id).data.metrics
    assert sorted(k for k in metrics if k.startswith("system/gpu_0_")) == [
        "system/gpu_0_memory_usage_megabytes",
        "system/gpu_0_memory_usage_percentage",
        "system/gpu_0_temperature_celsius",
        "system/gpu_0_utilization_percentage",
    ]  # no power: this simulated GPU has no power sensor
    assert "system/node_node-b/gpu_0_power_usage_watts" in metrics
    util = client.get_metric_history(run.run_id, "system/gpu_1_utilization_percentage")
    assert [m.step for m in sorted(util, key=lambda m: m.step)] == [0, 1]
    first_gpu1 = min(util, key=lambda m: m.step)
    assert first_gpu1.value == pytest.approx(first.gpus[1].utilization)
    assert first_gpu1.timestamp == int(first.time * 1000)
    remote_mem = client.get_metric_history(
        run.run_id, "system/node_node-b/gpu_0_memory_usage_megabytes"
    )
    assert [m.step for m in remote_mem] == [0]


def test_the_sink_needs_a_logger():
    with pytest.raises(TypeError, match="MlflowLogger"):
        SystemMetricsSink(object())
