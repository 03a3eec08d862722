"""What a demo run really did: its step history, its loss curve in MLflow, its recovery's events."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

from nbtools._demo.training import KILLED_KIND, RESUMED_KIND
from nbtools.events import Event

__all__ = [
    "Recovery",
    "recovery_from_events",
    "effective_history",
    "exactly_once_problems",
    "loss_curve",
    "continuity_problems",
    "prepare_experiment",
]


def effective_history(records_dir: str) -> dict[tuple[int, int], dict[str, Any]]:
    """Per ``(rank, step)``, the record of the latest attempt that ran the step.

    A step re-run after a restore replaces what the killed attempt recorded for
    it; steps the restored checkpoint covered keep the killed attempt's record.
    A line cut short by the kill is ignored.
    """
    history: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(records_dir, "rank*.jsonl"))):
        with open(path) as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                key = (record["rank"], record["step"])
                if key not in history or record["attempt"] >= history[key]["attempt"]:
                    history[key] = record
    return history


def exactly_once_problems(
    history: dict[tuple[int, int], dict[str, Any]], samples: int, steps: int, world_size: int
) -> list[str]:
    """Ways in which ``history`` misses a step or does not see every sample once per epoch."""
    problems = []
    missing = [(r, s) for s in range(steps) for r in range(world_size) if (r, s) not in history]
    if missing:
        problems.append(f"{len(missing)} (rank, step) pairs never ran, e.g. {missing[:3]}")
    per_epoch: dict[int, Counter[int]] = {}
    for record in history.values():
        per_epoch.setdefault(record["epoch"], Counter()).update(record["ids"])
    for epoch, counts in sorted(per_epoch.items()):
        twice = sorted(i for i, n in counts.items() if n > 1)
        never = sorted(set(range(samples)) - set(counts))
        if twice:
            problems.append(
                f"epoch {epoch}: {len(twice)} samples seen more than once, e.g. {twice[:5]}"
            )
        if never:
            problems.append(f"epoch {epoch}: {len(never)} samples never seen, e.g. {never[:5]}")
    return problems


def loss_curve(tracking_uri: str, run_id: str, key: str = "loss") -> dict[int, float]:
    """The metric of an MLflow run by step; a step logged twice keeps the latest value."""
    from mlflow import MlflowClient  # noqa: TID251 - reading back what nbtools.tracking wrote

    points = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, key)
    curve: dict[int, tuple[int, float]] = {}
    for m in points:
        if m.step not in curve or m.timestamp >= curve[m.step][0]:
            curve[m.step] = (m.timestamp, m.value)
    return {step: value for step, (_, value) in sorted(curve.items())}


def continuity_problems(tracking_uri: str, experiment: str, run_name: str, steps: int) -> list[str]:
    """Ways in which ``run_name`` is not ONE run with every step ``0 .. steps-1`` of its loss."""
    from mlflow import MlflowClient  # noqa: TID251 - reading back what nbtools.tracking wrote

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return [f"MLflow experiment {experiment!r} does not exist at {tracking_uri}"]
    runs = client.search_runs(
        [found.experiment_id], filter_string=f"attributes.run_name = '{run_name}'"
    )
    if len(runs) != 1:
        return [f"{len(runs)} MLflow runs are named {run_name!r}; expected one"]
    curve = loss_curve(tracking_uri, runs[0].info.run_id)
    missing = sorted(set(range(steps)) - set(curve))
    problems = []
    if missing:
        problems.append(f"MLflow run {runs[0].info.run_id} lacks loss at steps {missing[:10]}")
    if runs[0].info.status != "FINISHED":
        problems.append(f"MLflow run {runs[0].info.run_id} ended {runs[0].info.status}")
    return problems


def prepare_experiment(tracking_uri: str, name: str, artifact_dir: str) -> str:
    """Create (or find) the experiment, with artifacts under ``artifact_dir``; its id."""
    from mlflow import MlflowClient  # noqa: TID251 - the store is set up before the ranks start

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(
        name, artifact_location=pathlib.Path(artifact_dir).resolve().as_uri()
    )


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What the recovery took, from the run's events.

    Attributes:
        seconds: From the kill to the end of the next step (every rank past its all-reduce).
        trained_again: Steps trained before the kill and again after the restore.
        restored_step: The step the restore loaded.
        tier: Where the restore came from (``"memory"``, ``"replica"`` or ``"volume"``).
    """

    seconds: float
    trained_again: int
    restored_step: int
    tier: str

    def line(self) -> str:
        """``recovery: 1.4 s from the kill to the next step, 1 step trained again, ...``."""
        again = f"{self.trained_again} step{'s' * (self.trained_again != 1)}"
        return (
            f"recovery: {self.seconds:.1f} s from the kill to the next step, {again} trained "
            f"again, restored from {self.tier}"
        )


def recovery_from_events(events: Iterable[Event]) -> Recovery | None:
    """The recovery of a killed run, from its kill, its restore and its next step; None
    when the events do not hold all three (the run was not killed, or events were lost)."""
    kill = restored = resumed = None
    for event in sorted(events, key=lambda e: e.time):
        if event.kind == KILLED_KIND and kill is None:
            kill = event
        elif kill is not None and event.kind == "checkpoint_restored" and restored is None:
            restored = event
        elif restored is not None and event.kind == RESUMED_KIND and resumed is None:
            resumed = event
    if kill is None or restored is None or resumed is None:
        return None
    if kill.step is None or restored.step is None:
        return None
    return Recovery(
        seconds=resumed.time - kill.time,
        trained_again=kill.step - restored.step,
        restored_step=restored.step,
        tier=str(restored.fields.get("tier", "a checkpoint")),
    )
