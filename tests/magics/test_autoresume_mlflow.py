"""``%%autoresume --mlflow``: the MLflow run travels in the checkpoint and is resumed."""

from __future__ import annotations

import pytest

checkpoint_pkg = pytest.importorskip("nbtools.checkpoint")
if not hasattr(checkpoint_pkg, "CheckpointManager"):  # pragma: no cover - not built yet
    pytest.skip("nbtools.checkpoint has no CheckpointManager yet", allow_module_level=True)
pytest.importorskip("torch")
pytest.importorskip("mlflow")

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.linspace(-1, 1, 16).reshape(4, 4)
"""
CELL = """%%autoresume {root} --every 2 --state model,optimizer --mlflow --run-name {name}
for step in range(start_step, 12):
    if step == stop_at:
        raise KeyboardInterrupt
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    mlflow_logger.log_metric("loss", loss.item(), step=step)
    checkpoint(step)
"""


@pytest.fixture
def tracking(tmp_path, monkeypatch, mlflow_store):
    from mlflow import MlflowClient

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    uri = mlflow_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(tracking_uri=uri)


@pytest.mark.slow
def test_an_interrupted_cell_continues_the_same_mlflow_run(ip, tmp_path, tracking, capsys):
    root = tmp_path / "ckpt"
    notebook = tmp_path / "project" / "train.ipynb"
    ip.user_ns["__session__"] = str(notebook)  # what JupyterLab's kernel would have
    assert ip.run_cell(SETUP + "stop_at = 7\n").success

    result = ip.run_cell(CELL.format(root=root, name="sgd-demo"))
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    out = capsys.readouterr().out
    assert "started an MLflow run" in out
    run_id = ip.user_ns["mlflow_logger"].run_id
    run = tracking.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "sgd-demo"
    assert tracking.get_experiment(run.info.experiment_id).name == str(notebook.with_suffix(""))
    assert run.data.tags["mlflow.source.name"] == str(notebook)

    ip.user_ns["stop_at"] = None
    result = ip.run_cell(CELL.format(root=root, name="sgd-demo"))
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert f"restored step 6 from {root} into model, optimizer, MLflow run {run_id}" in out
    assert f"resumed MLflow run {run_id}" in out
    assert ip.user_ns["mlflow_logger"].closed
    run = tracking.get_run(run_id)
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in tracking.get_metric_history(run_id, "loss"))
    assert steps == list(range(12))  # one run, one continuous step axis
    assert len(tracking.search_runs([run.info.experiment_id])) == 1
