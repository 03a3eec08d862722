"""Every private MLflow name nbtools uses, in one place.

MLflow keeps the active runs of each thread on a stack it does not export
(``mlflow.tracking.fluent._active_run_stack``). nbtools puts a stand-in for a
run still being opened on it (see :mod:`nbtools.tracking._run`). Should a
release rename or reshape it, :func:`run_stack` returns None and the logger
opens its run on the caller's thread, as ``mlflow.start_run`` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_stack"]


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
