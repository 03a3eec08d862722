"""The one private MLflow name nbtools uses: the calling thread's stack of active runs."""

from __future__ import annotations

import threading

from nbtools.tracking._mlflow_compat import run_stack


def test_the_run_stack_is_the_list_mlflows_active_run_reads(tracking_uri):
    import mlflow

    stack = run_stack()
    assert stack == [], "this MLflow has no per-thread run stack: the logger would open runs on the caller's thread"
    with mlflow.start_run() as run:
        assert run_stack() is stack and stack[-1] is mlflow.active_run() is run
        seen: list = []
        thread = threading.Thread(target=lambda: seen.append(run_stack()))
        thread.start()
        thread.join()
        assert seen == [[]]  # another thread has its own stack
    assert stack == []
