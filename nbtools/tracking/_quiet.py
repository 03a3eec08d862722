"""MLflow on a rank other than 0: the calls of a training script work and record nothing.

Lightning (``rank_zero_only``), Hugging Face (``is_world_process_zero``) and
accelerate log from global rank 0 only; plain MLflow does not, so the same
script run on N ranks makes N runs. :func:`quiet_this_rank` gives the other
ranks the rank-zero behaviour for MLflow's own API:

- ``mlflow.start_run(...)`` returns an ``ActiveRun`` that records nothing,
  with the ``run_id`` asked for (a resumed run keeps its id), and puts it on
  MLflow's run stack, so ``mlflow.active_run()`` and ``with`` blocks behave;
  ``mlflow.end_run()`` takes it off again;
- autologging integrations call the library's own function, with no run;
- ``mlflow.log_*``, ``set_tag(s)`` and ``delete_tag`` do nothing.

``MlflowClient`` is left alone: code that must write from another rank can.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.tracking._mlflow_compat import run_stack, turn_autologging_off

__all__ = ["QuietRun", "quiet_this_rank", "WRITES"]

_log = get_logger("tracking")

#: The fluent functions that write to the active run; they do nothing on a quiet rank.
WRITES = (
    "log_metric",
    "log_metrics",
    "log_param",
    "log_params",
    "set_tag",
    "set_tags",
    "delete_tag",
    "log_artifact",
    "log_artifacts",
    "log_text",
    "log_dict",
    "log_figure",
    "log_image",
    "log_table",
    "log_input",
    "log_inputs",
)
_done = False


class QuietRun:
    """Marks an ``ActiveRun`` made on a rank that records nothing."""


def _quiet_run(
    rank: int, run_id: str | None, experiment_id: str | None, run_name: str | None
) -> Any:
    import mlflow
    from mlflow.entities import Run, RunData, RunInfo

    info = RunInfo(
        run_id=run_id or f"rank{rank}-not-recorded",
        experiment_id=experiment_id or "",
        user_id="",
        status="RUNNING",
        start_time=int(time.time() * 1000),
        end_time=None,
        lifecycle_stage="active",
        run_name=run_name or "",
    )

    class _Run(mlflow.ActiveRun, QuietRun):
        pass

    return _Run(Run(info, RunData()))


def quiet_this_rank(rank: int, on_first_run: Callable[[], None] | None = None) -> None:
    """Make MLflow's run API record nothing in this process (a rank other than 0). Idempotent.

    ``on_first_run`` is called when the process's code starts its first run
    (the first ``mlflow.start_run``); an error in it never reaches that code.
    """
    global _done
    if _done:
        return
    first: list[Callable[[], None]] = [on_first_run] if on_first_run is not None else []
    import mlflow
    from mlflow.tracking import fluent

    original_start, original_end = fluent.start_run, fluent.end_run

    @functools.wraps(original_start)
    def start_run(
        run_id: str | None = None,
        experiment_id: str | None = None,
        run_name: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        run = _quiet_run(rank, run_id, experiment_id, run_name)
        try:
            callback = first.pop()  # atomic: one thread gets it
        except IndexError:
            pass
        else:
            _tell(callback)
        stack = run_stack()
        if stack is not None:
            stack.append(run)
        return run

    @functools.wraps(original_end)
    def end_run(*args: Any, **kwargs: Any) -> None:
        stack = run_stack()
        if stack and isinstance(stack[-1], QuietRun):
            stack.pop()
            return
        original_end(*args, **kwargs)

    patched: dict[str, Callable[..., Any]] = {"start_run": start_run, "end_run": end_run}
    for name in WRITES:
        original = getattr(fluent, name, None)
        if original is not None:
            patched[name] = _does_nothing(original)
    for module in (mlflow, fluent):
        for name, function in patched.items():
            if getattr(module, name, None) is not None:
                setattr(module, name, function)
    if not turn_autologging_off():
        _log.warning(
            "this MLflow (%s) has no autologging switch nbtools knows; autologging on rank %d "
            "may open a run of its own",
            mlflow.__version__,
            rank,
        )
    _done = True


def _tell(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception as exc:  # noqa: BLE001 - a notice never breaks the script's start_run
        _log.debug("the quiet run notice failed: %s", exc)


def _does_nothing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def quiet(*args: Any, **kwargs: Any) -> None:
        return None

    return quiet
