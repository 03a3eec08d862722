"""Every private MLflow name nbtools uses, in one place.

MLflow keeps the active runs of each thread on a stack it does not export
(``mlflow.tracking.fluent._active_run_stack``). nbtools puts a stand-in for a
run still being opened on it (see :mod:`nbtools.tracking._run`), and the runs
that record nothing on ranks other than 0 (:mod:`nbtools.tracking._quiet`).
Should a release rename or reshape it, :func:`run_stack` returns None and the
logger opens its run on the caller's thread, as ``mlflow.start_run`` does.

Autologging asks ``mlflow.utils.autologging_utils.autologging_is_disabled``
before each patched call (``fit``, ``train``) whether to log; answering True
makes it call the library's own function, with no run. Should a release drop
that function, :func:`turn_autologging_off` returns False and says why.

What the kernel set with ``mlflow.set_tracking_uri()`` and
``mlflow.set_experiment()`` lives in module globals MLflow does not export
(``_tracking_service.utils.is_tracking_uri_set``, ``fluent._active_experiment_id``);
:func:`chosen_tracking_uri` and :func:`chosen_experiment_id` read them, and
return None when a release moves them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chosen_experiment_id", "chosen_tracking_uri", "run_stack", "turn_autologging_off"]


def run_stack() -> list[Any] | None:
    """The calling thread's stack of MLflow's active runs, or None when this MLflow has none."""
    try:
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
    except (ImportError, AttributeError, TypeError):
        return None
    if not isinstance(stack, list):
        return None
    active = fluent.active_run()
    if (active is None) != (not stack) or (stack and stack[-1] is not active):
        return None  # not the list active_run() reads: do not guess
    return stack


def turn_autologging_off() -> bool:
    """Make every MLflow autologging integration in this process do nothing; False if unsupported."""
    try:
        from mlflow.utils import autologging_utils
    except ImportError:
        return False
    if not callable(getattr(autologging_utils, "autologging_is_disabled", None)):
        return False

    def autologging_is_disabled(integration_name: str) -> bool:  # MLflow's signature
        return True

    autologging_utils.autologging_is_disabled = autologging_is_disabled
    return True


def chosen_tracking_uri() -> str | None:
    """The tracking URI this process chose (``set_tracking_uri`` or the variable); None for the default."""
    import mlflow

    try:
        from mlflow.tracking._tracking_service import utils

        chosen = utils.is_tracking_uri_set()
    except (ImportError, AttributeError):
        return None
    return mlflow.get_tracking_uri() if chosen else None


def chosen_experiment_id() -> str | None:
    """The experiment ``mlflow.set_experiment()`` made active in this process; None if none."""
    try:
        from mlflow.tracking import fluent

        active = fluent._active_experiment_id
    except (ImportError, AttributeError):
        return None
    return active if isinstance(active, str) and active else None
