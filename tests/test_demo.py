"""The demo's building blocks in one process: sample files, decoding, and the checks it reports.

The multi-process run itself is tests/integration/test_autorecovery.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from nbtools._demo import (
    DecodedSamples,
    effective_history,
    exactly_once_problems,
    make_volume,
    run_demo,
    steps_per_epoch,
)
from nbtools._demo.samples import decode
from nbtools.data import DataLoader, VolumeDataset


def test_sample_files_decode_to_their_ids(tmp_path):
    paths = make_volume(tmp_path / "vol", 6)
    assert make_volume(tmp_path / "vol", 6) == paths  # idempotent
    ids, xs = [], []
    for path in paths:
        with open(path, "rb") as fh:
            sample_id, x, y = decode(fh.read())
        ids.append(int(sample_id))
        xs.append(x)
        assert x.shape == (16,) and y.shape == (1,)
    assert ids == list(range(6))
    assert not torch.equal(xs[0], xs[1])
    with pytest.raises(ValueError, match="bytes"):
        decode(b"short")


def test_decoded_samples_resume_through_the_loader_state(tmp_path):
    make_volume(tmp_path / "vol", 12)

    def loader():
        files = VolumeDataset(tmp_path / "vol", shuffle=True, seed=3, cache_dir=tmp_path / "cache")
        return DataLoader(DecodedSamples(files), batch_size=4, num_workers=0)

    first = loader()
    it = iter(first)
    seen = next(it)[0].tolist()
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    rest = [i for ids, _, _ in second for i in ids.tolist()]
    assert sorted(seen + rest) == list(range(12))


def test_steps_per_epoch_needs_full_batches():
    assert steps_per_epoch(128, 2, 8) == 8
    with pytest.raises(ValueError, match="multiple of 16"):
        steps_per_epoch(100, 2, 8)


def _write(path, records):
    with open(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def _rec(attempt, step, ids, rank=0, epoch=0):
    return {"attempt": attempt, "step": step, "epoch": epoch, "rank": rank, "ids": ids, "loss": 0.0}


def test_a_rerun_step_replaces_the_killed_attempts_record(tmp_path):
    _write(
        tmp_path / "rank0.jsonl",
        [_rec(0, 0, [0, 1]), _rec(0, 1, [2, 3]), _rec(1, 1, [2, 3]), _rec(1, 2, [4, 5])],
    )
    with open(tmp_path / "rank0.jsonl", "a") as fh:
        fh.write('{"attempt": 0, "st')  # cut short by the kill
    history = effective_history(str(tmp_path))
    assert sorted(history) == [(0, 0), (0, 1), (0, 2)]
    assert [history[(0, s)]["attempt"] for s in range(3)] == [0, 1, 1]
    assert exactly_once_problems(history, samples=6, steps=3, world_size=1) == []


def test_exactly_once_check_reports_duplicates_gaps_and_missing_steps(tmp_path):
    _write(tmp_path / "rank0.jsonl", [_rec(0, 0, [0, 1]), _rec(0, 1, [1, 3])])
    problems = exactly_once_problems(
        effective_history(str(tmp_path)), samples=4, steps=3, world_size=1
    )
    assert any("never ran" in p for p in problems)
    assert any("more than once" in p and "[1]" in p for p in problems)
    assert any("never seen" in p and "[2]" in p for p in problems)


def test_demo_refuses_a_directory_it_did_not_make(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert run_demo(str(tmp_path)) == 2
    assert "was not made by the demo" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


def test_train_runs_in_process_and_continues_its_mlflow_run(tmp_path):
    from mlflow import MlflowClient

    from nbtools._demo import DemoConfig, loss_curve, train

    make_volume(tmp_path / "vol", 16)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = DemoConfig(
        volume=str(tmp_path / "vol"),
        run_dir=str(tmp_path / "run"),
        cache_dir=str(tmp_path / "cache"),
        tracking_uri=uri,
        epochs=1,
        every=2,
        verbose=False,
    )
    first = train(cfg)  # a plain call: one process, no group, 2 steps
    assert (first["restart"], first["restored_step"], first["steps"]) == (0, None, 2)
    # The first run ended normally, so its last step (1) was saved on close: nothing repeats.
    again = train(cfg.replace(epochs=2))
    assert again["restored_step"] == 1 and again["steps"] == 4
    assert again["run_id"] == first["run_id"]
    assert sorted(loss_curve(uri, first["run_id"])) == [0, 1, 2, 3]
    assert MlflowClient(tracking_uri=uri).get_run(first["run_id"]).info.status == "FINISHED"


def test_the_demo_writes_the_pane_timeline_of_its_run(tmp_path, clean_bus):
    pytest.importorskip("anywidget")
    from nbtools import events
    from nbtools._demo.cli import _MARKER, _close_pane, _open_pane

    (tmp_path / _MARKER).write_text("made by the demo")
    pane = _open_pane()  # as the demo does: this machine's GPUs (none here), not shown
    events.emit("checkpoint_saved", message="saved step_8", step=8, blocked_s=0.2)
    events.emit("rank_failed", message="rank 1 exited with SIGKILL (signal 9)", rank=1)
    events.emit("restart", message="restarting all 2 ranks (restart 1 of 2)", attempt=1)
    path = _close_pane(pane, str(tmp_path / "timeline.html"))
    assert pane.status == "closed"
    assert path == str(tmp_path / "timeline.html")
    text = (tmp_path / "timeline.html").read_text()
    for kind in ("checkpoint_saved", "rank_failed", "restart"):
        assert kind in text
    assert "Plotly.newPlot" in text  # plotly.js inside: opens without a network
