"""Facts about the surrounding experiment that core packages may record.

Core packages must not import mlflow; this module looks for an MLflow run
only if mlflow is already imported by the user or by ``nbtools.tracking``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["active_mlflow_run_id"]


def active_mlflow_run_id() -> str | None:
    """The id of the active MLflow run, or ``MLFLOW_RUN_ID``, or None."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        try:
            run = mlflow.active_run()
            run_id = None if run is None else run.info.run_id  # a run still opening: waits
        except Exception:  # noqa: BLE001 - a broken tracking setup must not break a save
            run_id = None
        if run_id:
            return run_id
    tracker = sys.modules.get("nbtools.tracking.mlflow")
    if tracker is not None:
        run_id = getattr(tracker, "current_run_id", lambda: None)()
        if run_id:
            return run_id
    return os.environ.get("MLFLOW_RUN_ID") or None
