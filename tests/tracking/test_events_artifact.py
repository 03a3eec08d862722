"""``MlflowLogger(events_to_mlflow=True)`` keeps the run's events as a JSON-lines artifact."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from nbtools import events
from nbtools.tracking import MlflowLogger

pytestmark = pytest.mark.usefixtures("clean_bus")


@pytest.fixture
def experiment(client, tmp_path):
    """An experiment whose artifacts live in the test's temporary directory."""
    name = f"events-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    return name


def _events_files(client, run_id: str, tmp_path) -> list[list[dict]]:
    listed = sorted(a.path for a in client.list_artifacts(run_id, "events"))
    root = Path(urlparse(client.get_run(run_id).info.artifact_uri).path)
    out = []
    for path in listed:
        assert path.endswith(".jsonl")
        with open(root / path, encoding="utf-8") as fh:
            out.append([json.loads(line) for line in fh])
    return out


@pytest.mark.slow
def test_the_events_of_the_run_are_stored_when_the_logger_closes(client, experiment, tmp_path):
    events.emit("before", message="emitted before the logger: not part of the run")
    with MlflowLogger(experiment, run_name="with-events", events_to_mlflow=True) as run:
        run.log_metric("loss", 1.0, step=0)
        events.emit("checkpoint_saved", message="saved step_100", step=100, blocked_s=0.4)
        events.emit("eval", message="val loss 1.93", step=100, value=1.93, split="val")
        events.bus().publish([], dropped=3, source=("node1", 1, 99))
    files = _events_files(client, run.run_id, tmp_path)
    assert len(files) == 1
    lines = files[0]
    assert [line["kind"] for line in lines] == ["checkpoint_saved", "eval"]
    saved, evaluated = lines
    assert (
        saved["step"] == 100 and saved["blocked_s"] == 0.4 and saved["message"] == "saved step_100"
    )
    assert evaluated["value"] == 1.93 and evaluated["split"] == "val"
    assert {"time", "host", "rank", "pid"} <= set(saved)
    assert client.get_run(run.run_id).data.tags["nbtools.events_dropped"] == "3"
    assert run._recorder._arrived not in events.bus()._subscribers


@pytest.mark.slow
def test_a_resumed_run_keeps_the_events_of_every_session(client, experiment, tmp_path):
    with MlflowLogger(experiment, events_to_mlflow=True) as first:
        events.emit("launch", message="2 ranks")
    with MlflowLogger(run_id=first.run_id, events_to_mlflow=True) as second:
        events.emit("restart", message="restarting all 2 ranks")
    assert second.run_id == first.run_id
    files = _events_files(client, first.run_id, tmp_path)
    assert sorted(line["kind"] for lines in files for line in lines) == ["launch", "restart"]


def test_events_stay_out_of_mlflow_unless_asked(client, experiment):
    with MlflowLogger(experiment) as run:
        events.emit("eval", value=1.0)
    assert client.list_artifacts(run.run_id, "events") == []
    assert len(events.bus()._subscribers) == 0


def test_other_ranks_record_nothing(client, experiment, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with MlflowLogger(experiment, events_to_mlflow=True) as run:
        events.emit("eval", value=1.0)
    assert not run.enabled and run._recorder is None
