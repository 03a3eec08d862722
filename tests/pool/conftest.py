"""Fixtures of the pool tests: the forkserver, IPython's own shell."""

from __future__ import annotations

import sys

import pytest

from nbtools.launch import _env


@pytest.fixture(scope="session", autouse=True)
def forkserver_running():
    """Start the interpreter-owned forkserver before the per-test leak checks begin."""
    _env.warm_up()


@pytest.fixture(scope="session")
def _shell():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
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
    """The shell with nbtools loaded; its pool is stopped and its names removed afterwards."""
    before = set(_shell.user_ns)
    _shell.run_line_magic("load_ext", "nbtools")
    yield _shell
    _shell.run_line_magic("distributed", "stop")
    _shell.run_line_magic("unload_ext", "nbtools")
    for name in set(_shell.user_ns) - before:
        del _shell.user_ns[name]
