"""Experiment tracking with MLflow: the only nbtools package that imports mlflow.

Example:
    >>> from nbtools.tracking import MlflowLogger
    >>> with MlflowLogger(run_name="baseline", log_every=10) as run:  # doctest: +SKIP
    ...     run.log_metric("loss", 0.5, step=0)

Besides the logger, the front door exports what ``nbtools doctor`` asks of a tracking store
without opening it: :func:`is_http`, :func:`probe` (does a server answer) and
:func:`sqlite_path` (the database file of a ``sqlite:`` URI).
"""

from __future__ import annotations

from nbtools.tracking._local_store import sqlite_path
from nbtools.tracking._store import is_http, probe
from nbtools.tracking.mlflow import MAX_STEPS_PER_METRIC, MlflowLogger, current_run_id
from nbtools.tracking.naming import experiment_name, notebook_path
from nbtools.tracking.system import SystemMetricsSink

__all__ = [
    "MAX_STEPS_PER_METRIC",
    "MlflowLogger",
    "SystemMetricsSink",
    "current_run_id",
    "experiment_name",
    "is_http",
    "notebook_path",
    "probe",
    "sqlite_path",
]
