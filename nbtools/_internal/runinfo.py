"""Facts about the surrounding experiment that core packages may record.

Core packages must not import mlflow; this module looks for an MLflow run
only if mlflow is already imported by the user. Higher layers that know of a
run (``nbtools.tracking``) register a provider here when they are imported:
this base layer never looks them up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["active_mlflow_run_id", "register_run_id_provider"]

_providers: list[Callable[[], str | None]] = []


def register_run_id_provider(provider: Callable[[], str | None]) -> None:
    """Ask ``provider()`` for a run id too (after MLflow's active run); once per provider."""
    if provider not in _providers:
        _providers.append(provider)


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
    for provider in list(_providers):
        try:
            run_id = provider()
        except Exception:  # noqa: BLE001 - a broken provider must not break a save
            run_id = None
        if run_id:
            return run_id
    return os.environ.get("MLFLOW_RUN_ID") or None
