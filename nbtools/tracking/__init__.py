"""Experiment tracking with MLflow: the only nbtools package that imports mlflow.

Example:
    >>> from nbtools.tracking import MlflowLogger
    >>> with MlflowLogger(run_name="baseline", log_every=10) as run:  # doctest: +SKIP
    ...     run.log_metric("loss", 0.5, step=0)
"""

from __future__ import annotations

from nbtools.tracking.mlflow import MAX_STEPS_PER_METRIC, MlflowLogger, current_run_id
from nbtools.tracking.naming import experiment_name, notebook_path
from nbtools.tracking.system import SystemMetricsSink

__all__ = [
    "MAX_STEPS_PER_METRIC",
    "MlflowLogger",
    "SystemMetricsSink",
    "current_run_id",
    "experiment_name",
    "notebook_path",
]
