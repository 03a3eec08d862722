"""Fixtures of the pool tests: IPython's own shell (the forkserver: ``tests/launch/conftest.py``)."""

from __future__ import annotations

import pytest


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
