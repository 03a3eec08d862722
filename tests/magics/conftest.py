"""IPython's own shell, without a terminal or a history file, with ``%load_ext nbtools``."""

from __future__ import annotations

import os

import pytest

# See tests/tracking/conftest.py: MLflow's telemetry changes the environment from a thread.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture(scope="session", autouse=True)
def _torch_first_use():
    """Let torch make its process-wide first-use changes before any test is checked for leaks.

    Creating the first optimizer sets TORCHINDUCTOR_CACHE_DIR and creates that
    directory in the temporary directory, once per process.
    """
    try:
        import torch
    except ImportError:
        return
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


@pytest.fixture
def ip(_shell):
    """The shell with nbtools loaded; names a test defines are removed afterwards."""
    before = set(_shell.user_ns)
    _shell.run_line_magic("load_ext", "nbtools")
    yield _shell
    _shell.run_line_magic("unload_ext", "nbtools")
    for name in set(_shell.user_ns) - before:
        del _shell.user_ns[name]
