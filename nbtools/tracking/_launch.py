"""MLflow inside ``@distributed``: one store created once, one run per training.

Plain MLflow in N ranks behaves as N independent scripts: every rank that calls
``mlflow.start_run()`` or trains under autologging opens a run of its own, and
on a new local store every rank creates the database at once (one of them fails
with ``table experiments already exists`` and loses what it was to log). A
notebook user expects one run per training, as Lightning and Hugging Face log
only on global rank 0. The launcher calls two functions here (registered by
``nbtools/__init__.py`` through :mod:`nbtools._internal.hooks`):

- :func:`before_launch`, in the kernel before ranks start: the tracking URI and
  experiment the kernel chose (``mlflow.set_tracking_uri``/``set_experiment``
  or the variables) reach the ranks, and a local sqlite store that does not
  exist yet is created there, once, under the store's creation lock, so the
  ranks only open it.
- :func:`in_rank`, in each rank once it imports ``mlflow``: on ranks other than
  0, MLflow records nothing (:mod:`nbtools.tracking._quiet`). The first of them
  whose code really starts a run says so, once per job, in the cell's output
  (Lightning and Hugging Face start runs on rank 0 only: then nothing is said).
  Rank 0 runs MLflow unchanged: autologging,
  ``report_to="mlflow"``, ``MLFLOW_EXPERIMENT_NAME`` and
  ``mlflow.start_run(run_id=...)`` work there as documented by MLflow.
"""

from __future__ import annotations

import os
import sys

from nbtools._internal.log import get_logger
from nbtools.runtime import get_rank, get_world_size

__all__ = ["before_launch", "in_rank", "notice", "RANKS_NOTICE"]

_log = get_logger("tracking")

#: What the first rank other than 0 that starts a run says, once per job.
RANKS_NOTICE = (
    "MLflow in %d ranks: rank 0 records the runs. On %s, mlflow.start_run() returns "
    "a run that records nothing, autologging is off and mlflow.log_*/set_tag* do nothing, "
    "so each training is one run (use MlflowClient there to write anyway)"
)
#: The key of the job's store that lets one rank say it.
_NOTICE_KEY = "nbtools/tracking/quiet-run-notice"


def before_launch() -> None:
    """Hand the kernel's MLflow choices to the ranks; create a new local store once (kernel side).

    The ranks inherit this process's environment when they start. MLflow's
    ``set_tracking_uri()``/``set_experiment()`` write ``MLFLOW_TRACKING_URI`` and
    ``MLFLOW_EXPERIMENT_ID`` there, but a rank would still read a stale
    ``MLFLOW_EXPERIMENT_NAME`` (MLflow refuses a name and an id that disagree),
    refuse an experiment its own code names, and resolve a relative sqlite path
    against its own directory. So the chosen store is passed as an absolute
    path, the chosen experiment by name only; this process's MLflow, which
    prefers those calls to the variables, is unchanged. Code in the ranks that
    sets the variables itself wins. MLflow's default store is left to rank 0,
    the only rank that opens it.
    """
    from nbtools.tracking._local_store import prepare_store, sqlite_path
    from nbtools.tracking._mlflow_compat import chosen_experiment_id, chosen_tracking_uri

    uri = chosen_tracking_uri()
    if uri is not None:
        path = sqlite_path(uri)
        os.environ["MLFLOW_TRACKING_URI"] = uri if path is None else f"sqlite:///{path}"
        if prepare_store(uri):
            _log.debug("the MLflow store at %s is ready for the ranks", uri)
    experiment_id = chosen_experiment_id()
    if experiment_id is not None:
        _pass_experiment(experiment_id)


def _pass_experiment(experiment_id: str) -> None:
    import mlflow

    experiment = mlflow.MlflowClient().get_experiment(experiment_id)
    os.environ["MLFLOW_EXPERIMENT_NAME"] = experiment.name
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)  # the name says it; a rank may name another
    _log.debug("the ranks use the MLflow experiment %s", experiment.name)


def in_rank() -> None:
    """Make MLflow record on rank 0 only (rank side, once ``mlflow`` is imported)."""
    world = get_world_size()
    if world < 2:
        return
    rank = get_rank()
    if rank == 0:
        return
    from nbtools.tracking._quiet import quiet_this_rank

    quiet_this_rank(rank, on_first_run=lambda: _tell_once(world))


def notice(world: int) -> str:
    """The line a job of ``world`` ranks shows when a rank other than 0 starts a run."""
    others = "rank 1" if world == 2 else f"ranks 1-{world - 1}"
    return RANKS_NOTICE % (world, others)


def _tell_once(world: int) -> None:
    """Say what a quiet run is, unless another rank of the job said it already.

    Called on a rank other than 0, whose records the ``nbtools`` logger drops, so
    the line goes to stderr in the logger's format; the cell shows it as
    ``[rank N] nbtools: WARNING: ...``.
    """
    if _first_in_job():
        print(f"nbtools: WARNING: {notice(world)}", file=sys.stderr, flush=True)


def _first_in_job() -> bool:
    """True for the first rank of the job to ask (its process group's store counts); else False.

    Without a process group (a script that set ``RANK`` itself) every process is first.
    """
    try:
        import torch.distributed as dist

        default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        if default_store is None or not dist.is_initialized():
            return True
        return int(default_store().add(_NOTICE_KEY, 1)) == 1
    except Exception:  # noqa: BLE001 - a store that cannot count says it on this rank
        return True
