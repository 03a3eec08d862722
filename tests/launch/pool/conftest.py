"""Fixtures of the pool tests: the forkserver, IPython's own shell."""

from __future__ import annotations

import pytest

from nbtools.launch import _env


@pytest.fixture(scope="session", autouse=True)
def forkserver_running():
    """Start the interpreter-owned forkserver before the per-test leak checks begin."""
    _env.warm_up()


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
