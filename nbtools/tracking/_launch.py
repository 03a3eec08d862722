"""MLflow inside ``@distributed``: one store created once, one run per training.

Plain MLflow in N ranks behaves as N independent scripts: every rank that calls
``mlflow.start_run()`` or trains under autologging opens a run of its own, and
on a new local store every rank creates the database at once (one of them fails
with ``table experiments already exists`` and loses what it was to log). A
notebook user expects one run per training, as Lightning and Hugging Face log
only on global rank 0. The launcher calls two functions here (registered by
``nbtools/__init__.py`` through :mod:`nbtools._internal.hooks`):

- :func:`before_launch`, in the kernel before ranks start: a local sqlite store
  that does not exist yet is created there, once, under the store's creation
  lock, so the ranks only open it.
- :func:`in_rank`, in each rank once it imports ``mlflow``: on ranks other than
  0, MLflow records nothing (:mod:`nbtools.tracking._quiet`); rank 0 says so
  once in the cell's output. Rank 0 runs MLflow unchanged: autologging,
  ``report_to="mlflow"``, ``MLFLOW_EXPERIMENT_NAME`` and
  ``mlflow.start_run(run_id=...)`` work there as documented by MLflow.
"""

from __future__ import annotations

import os

from nbtools._internal.log import get_logger
from nbtools.runtime import get_rank, get_world_size

__all__ = ["before_launch", "in_rank", "RANKS_NOTICE"]

_log = get_logger("tracking")

#: What rank 0 says once per launch of several ranks that use MLflow.
RANKS_NOTICE = (
    "MLflow in %d ranks: rank 0 records the runs. On ranks 1-%d, mlflow.start_run() returns "
    "a run that records nothing, autologging is off and mlflow.log_*/set_tag* do nothing, "
    "so each training is one run (use MlflowClient there to write anyway)"
)


def before_launch() -> None:
    """Create the local store the ranks will use, if it is new (kernel side)."""
    import mlflow

    from nbtools.tracking._local_store import prepare_store

    uri = os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    if prepare_store(uri):
        _log.debug("the MLflow store at %s is ready for the ranks", uri)


def in_rank() -> None:
    """Make MLflow record on rank 0 only (rank side, once ``mlflow`` is imported)."""
    world = get_world_size()
    if world < 2:
        return
    rank = get_rank()
    if rank == 0:
        _log.warning(RANKS_NOTICE, world, world - 1)
        return
    from nbtools.tracking._quiet import quiet_this_rank

    quiet_this_rank(rank)
