"""IPython's own shell, without a terminal or a history file, with ``%load_ext nbtools``."""

from __future__ import annotations

import os
import sys

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


@pytest.fixture(scope="session")
def _shell():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
    # The shell replaces a few interpreter hooks; give them back, as IPython's own
    # test harness does, so that pytest keeps reporting normally.
    saved = sys.displayhook, sys.excepthook, sys.modules.get("__main__")
    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no file, no history thread
    shell = InteractiveShell.instance(config=config)
    sys.displayhook, sys.excepthook = saved[0], saved[1]
    if saved[2] is not None:
        sys.modules["__main__"] = saved[2]
    return shell


@pytest.fixture
def ip(_shell):
    """The shell with nbtools loaded; names a test defines are removed afterwards."""
    before = set(_shell.user_ns)
    _shell.run_line_magic("load_ext", "nbtools")
    yield _shell
    _shell.run_line_magic("unload_ext", "nbtools")
    for name in set(_shell.user_ns) - before:
        del _shell.user_ns[name]
