"""Automatic recovery end to end: 2 gloo ranks train, rank 1 is SIGKILLed, the group recovers.

One ``@distributed(processes=2, max_restarts=2)`` run trains a DDP model on
``VolumeDataset``/``DataLoader`` data with async ``CheckpointManager`` saves and
MLflow logging; on its first attempt rank 1 kills itself mid-epoch. An
uninterrupted run of the same length is the reference. The recovered run must
end with the same parameters, have seen every sample of every epoch exactly
once, and be one MLflow run with every step of its loss.
"""

from __future__ import annotations

import json
import os

import torch

from nbtools._demo import effective_history, loss_curve, report, run_pair

SAMPLES, EPOCHS, KILL_AT, WORLD = 64, 3, 9, 2  # 4 steps per epoch: killed in epoch 2


def _raw_records(records_dir: str) -> list[dict]:
    out = []
    for rank in range(WORLD):
        with open(os.path.join(records_dir, f"rank{rank}.jsonl")) as fh:
            out += [json.loads(line) for line in fh]
    return out


def test_a_killed_rank_recovers_and_finishes_like_an_uninterrupted_run(tmp_path):
    # One pair of runs (three launches) serves every check: starting ranks is what costs.
    outcome = run_pair(
        str(tmp_path / "demo"), samples=SAMPLES, epochs=EPOCHS, kill_at=KILL_AT, verbose=False
    )
    _check_the_group_was_killed_and_restarted_from_a_checkpoint(outcome)
    _check_final_parameters_equal_the_uninterrupted_run(outcome)
    _check_every_sample_of_every_epoch_is_seen_exactly_once(outcome)
    _check_mlflow_holds_one_run_with_a_continuous_step_axis(outcome)
    html = tmp_path / "recovery.html"
    assert report(outcome, str(html)) == []
    text = html.read_text()
    assert "killed and recovered run" in text and "uninterrupted run" in text


def _check_the_group_was_killed_and_restarted_from_a_checkpoint(outcome):
    steps = outcome.steps
    assert steps == EPOCHS * SAMPLES // (WORLD * outcome.recovered.batch_size) == 12
    assert [r["restart"] for r in outcome.recovered_results] == [1, 1]
    assert [r["restart"] for r in outcome.reference_results] == [0, 0]
    restored = outcome.recovered_results[0]["restored_step"]
    cadence = outcome.recovered.memory_every or outcome.recovered.every
    assert restored is not None and restored % cadence == 0 and restored <= KILL_AT
    # Every rank held a memory snapshot newer than the volume's checkpoint of step 8.
    assert [r["restored_tier"] for r in outcome.recovered_results] == ["memory", "memory"]
    assert restored > KILL_AT - 2 * cadence
    assert outcome.reference_results[0]["restored_step"] is None

    raw = _raw_records(outcome.recovered.records)
    first = [r for r in raw if r["attempt"] == 0]
    second = [r for r in raw if r["attempt"] == 1]
    # Attempt 0 stopped at the kill; attempt 1 re-ran every step after the restored one.
    assert max(r["step"] for r in first if r["rank"] == 1) == KILL_AT
    assert max(r["step"] for r in first) <= KILL_AT
    for rank in range(WORLD):
        assert sorted(r["step"] for r in second if r["rank"] == rank) == list(
            range(restored + 1, steps)
        )


def _check_final_parameters_equal_the_uninterrupted_run(outcome):
    ours = outcome.recovered_results[0]["params"]
    theirs = outcome.reference_results[0]["params"]
    assert ours.keys() == theirs.keys() and ours
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    # Equal because both trained, not because neither did.
    torch.manual_seed(outcome.recovered.seed)
    initial = torch.nn.Linear(16, outcome.recovered.hidden).weight
    assert not torch.equal(ours["0.weight"], initial)


def _check_every_sample_of_every_epoch_is_seen_exactly_once(outcome):
    history = effective_history(outcome.recovered.records)
    assert sorted(history) == [(r, s) for r in range(WORLD) for s in range(outcome.steps)]
    per_epoch: dict[int, list[int]] = {}
    for record in history.values():
        per_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
    # The samples of each step are those of the uninterrupted run, in the same batches.
    reference = effective_history(outcome.reference.records)
    assert {k: r["ids"] for k, r in history.items()} == {k: r["ids"] for k, r in reference.items()}


def _check_mlflow_holds_one_run_with_a_continuous_step_axis(outcome):
    from mlflow import MlflowClient

    cfg = outcome.recovered
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["recovered", "uninterrupted"]
    run = next(r for r in runs if r.info.run_name == "recovered")
    assert run.info.run_id == outcome.recovered_results[0]["run_id"]
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted({m.step for m in history}) == list(range(outcome.steps))
    # Steps logged again after the restore carry the values the killed attempt logged.
    by_step: dict[int, set[float]] = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(m.value)
    assert all(len(values) == 1 for values in by_step.values()), by_step
    reference = loss_curve(cfg.tracking_uri, outcome.reference_results[0]["run_id"])
    assert loss_curve(cfg.tracking_uri, run.info.run_id) == reference
    assert reference[outcome.steps - 1] < reference[0]
