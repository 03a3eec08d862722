"""The private MLflow names nbtools uses: the thread's stack of active runs, the autologging switch."""

from __future__ import annotations

import threading

import pytest

from nbtools.tracking._mlflow_compat import run_stack


@pytest.mark.slow
def test_the_run_stack_is_the_list_mlflows_active_run_reads(tracking_uri):
    import mlflow

    stack = run_stack()
    assert stack == [], (
        "this MLflow has no per-thread run stack: the logger would open runs on the caller's thread"
    )
    with mlflow.start_run() as run:
        assert run_stack() is stack and stack[-1] is mlflow.active_run() is run
        seen: list = []
        thread = threading.Thread(target=lambda: seen.append(run_stack()))
        thread.start()
        thread.join()
        assert seen == [[]]  # another thread has its own stack
    assert stack == []


@pytest.mark.slow
def test_autologging_asks_the_switch_that_turn_autologging_off_answers():
    # Run in a child: the switch stays off for the rest of the process.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        import inspect
        from mlflow.utils import autologging_utils
        from mlflow.utils.autologging_utils import safety
        assert "autologging_is_disabled" in inspect.getsource(safety.safe_patch)
        from nbtools.tracking._mlflow_compat import turn_autologging_off
        assert turn_autologging_off() is True
        assert autologging_utils.autologging_is_disabled("pytorch") is True
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
