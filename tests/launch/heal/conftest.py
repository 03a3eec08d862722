"""What the heal tests share: a script whose ``__main__`` defines the function, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest


@pytest.fixture
def run_cell(tmp_path) -> Callable[..., dict]:
    """Run ``cell`` (a script that prints ``RESULT <json>``) with a fresh directory and ``case``
    as its arguments; its result, with everything it printed under ``"output"``."""

    def run(cell: str, timeout: float, **case) -> dict:
        script = tmp_path / "cell.py"
        script.write_text(cell)
        base = tmp_path / "run"
        base.mkdir()
        done = subprocess.run(
            [sys.executable, str(script), str(base), json.dumps(case)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
        result = json.loads(lines[-1][len("RESULT ") :])
        result["output"] = done.stdout + done.stderr
        return dict(result)

    return run
