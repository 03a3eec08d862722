"""``%gpu_pane`` opens the monitor's pane (simulated GPUs here) and closes it again."""

from __future__ import annotations

import json
import threading

import pytest

monitor = pytest.importorskip("nbtools.monitor")
pytest.importorskip("ipywidgets")


def _sampler_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbtools-gpu")]


def test_simulated_pane_opens_replaces_and_closes(ip):
    pane = ip.run_line_magic("gpu_pane", "--simulated 2 --interval 5")
    try:
        assert isinstance(pane, monitor.GPUPane)
        assert pane.status == "polling"
        assert pane.sampler.simulated and pane.sampler.interval == 5
        assert len(pane.sampler.last_sample.gpus) == 2
        second = ip.run_line_magic("gpu_pane", "--simulated 3")
        assert pane.status == "closed" and second.status == "polling"
        assert len(second.sampler.last_sample.gpus) == 3
    finally:
        ip.run_line_magic("gpu_pane", "--close")
    assert second.status == "closed"
    assert _sampler_threads() == []


def test_unloading_the_extension_closes_the_pane(ip):
    pane = ip.run_line_magic("gpu_pane", "--simulated 1")
    ip.run_line_magic("unload_ext", "nbtools")
    ip.run_line_magic("load_ext", "nbtools")
    assert pane.status == "closed"
    assert _sampler_threads() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--simulated 0", "argument --simulated: invalid positive integer value: '0'"),
        ("--interval -1", "argument --interval: invalid positive number value: '-1'"),
        ("--bogus", "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line(ip, capsys, args, message):
    from IPython.core.error import UsageError

    result = ip.run_cell(f"%gpu_pane {args}")
    assert isinstance(result.error_in_exec, UsageError)
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: ") and message in lines[0], lines
    assert _sampler_threads() == []


@pytest.mark.slow
def test_pane_samples_become_mlflow_system_metrics_and_events_an_artifact(
    ip, tmp_path, monkeypatch
):
    mlflow = pytest.importorskip("mlflow")
    from nbtools import events

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps artifacts in ./mlruns
    pane = ip.run_line_magic("gpu_pane", "--simulated 2 --interval 60 --mlflow")
    try:
        pane.refresh()
        events.emit("eval", message="val loss 1.93", step=10, value=1.93)
        pane.refresh()
        run_id = ip.magics_manager.registry["NbtoolsMagics"]._pane_logger.run_id
    finally:
        ip.run_line_magic("gpu_pane", "--close")  # flushes what was sampled, stores the events
    client = mlflow.MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "system/gpu_1_utilization_percentage")
    assert len(history) >= 2  # the two refreshes (the first poll came before the sink)
    assert all(0 <= m.value <= 100 for m in history)
    assert client.get_metric_history(run_id, "system/gpu_0_temperature_celsius")
    (stored,) = client.list_artifacts(run_id, "events")
    root = client.get_run(run_id).info.artifact_uri.removeprefix("file://")
    with open(f"{root}/{stored.path}", encoding="utf-8") as fh:
        lines = [json.loads(line) for line in fh]
    assert [(e["kind"], e["step"], e["value"]) for e in lines] == [("eval", 10, 1.93)]
    assert mlflow.active_run() is None
    assert _sampler_threads() == []
