"""Starting, resuming or adopting the MLflow run of an :class:`~nbtools.tracking.MlflowLogger`."""

from __future__ import annotations

import os
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from nbtools.errors import TrackingError
from nbtools.tracking._store import probe
from nbtools.tracking.naming import experiment_name as _default_experiment_name
from nbtools.tracking.naming import notebook_path

__all__ = ["open_run"]


def open_run(
    client: Any, uri: str, experiment: str | None, run_name: str | None, run_id: str | None,
    tags: dict,
) -> tuple[Any, bool, bool]:
    """Make the logger's run MLflow's active run in this thread.

    Returns:
        ``(run, owned, resumed)``: ``owned`` when the logger started or resumed it
        (and so ends it); ``resumed`` when the run existed before (it may hold values).

    Raises:
        TrackingError: The server does not answer, the run cannot be resumed, or
            another run is active in this thread.
    """
    active = mlflow.active_run()
    if active is not None:
        if run_id is None or run_id == active.info.run_id:
            return active, False, True  # the caller's run: adopted, not ended by close()
        raise TrackingError(
            f"MLflow run {active.info.run_id} is active in this thread, so run {run_id} "
            "cannot be resumed; close the MlflowLogger that started it, or call "
            "mlflow.end_run(), first"
        )
    probe(uri)  # a server that is not there is reported in seconds, not minutes
    try:
        if run_id is not None:
            run = mlflow.start_run(run_id=run_id, run_name=run_name, tags=tags or None)
        else:
            source = notebook_path()
            if source:
                tags.setdefault("mlflow.source.name", source)
                tags.setdefault("mlflow.source.type", "NOTEBOOK")
            run = mlflow.start_run(
                experiment_id=_experiment_id(client, experiment), run_name=run_name, tags=tags
            )
    except MlflowException as exc:
        what = f"resume MLflow run {run_id}" if run_id else "start an MLflow run"
        hint = (
            "; point MLFLOW_TRACKING_URI at the store that holds it, or pass run_id=None "
            "(and unset MLFLOW_RUN_ID) to start a new run"
            if run_id else ""
        )
        raise TrackingError(f"cannot {what} at {uri}: {exc.message}{hint}") from exc
    return run, True, run_id is not None


def _experiment_id(client: Any, name: str | None) -> str:
    if name is None and not os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        from_env = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if from_env:
            return from_env
    name = name or _default_experiment_name()
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException:
            experiment = client.get_experiment_by_name(name)  # created meanwhile
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} is deleted; restore it "
            f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) "
            "or choose another name"
        )
    return experiment.experiment_id
