"""A local MLflow store per test module, selected per test through MLFLOW_TRACKING_URI."""

from __future__ import annotations

import os

import pytest

# MLflow's usage telemetry sets and clears an environment variable from a thread of
# its own (a leak by the fixtures' rules) and reaches for the network: off in tests.
# It must be off before mlflow is first imported.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

_MLFLOW_ENV = (
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_TRACKING_URI",
)


@pytest.fixture(scope="module")
def _store_uri(tmp_path_factory: pytest.TempPathFactory, mlflow_store) -> str:
    # A store of the module's own, copied from the test process's migrated one (tests/conftest.py).
    return mlflow_store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


@pytest.fixture
def tracking_uri(_store_uri: str, monkeypatch: pytest.MonkeyPatch):
    """Point MLflow at this module's store; no run may be left active by the test."""
    import mlflow

    for name in _MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _store_uri)
    yield _store_uri
    left = mlflow.active_run()
    while mlflow.active_run() is not None:
        mlflow.end_run()
    assert left is None, f"the test left MLflow run {left.info.run_id} active"


@pytest.fixture
def client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)
