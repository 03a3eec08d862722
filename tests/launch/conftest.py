"""Fixtures of the launcher tests."""

from __future__ import annotations

import pytest

from nbtools.launch import _env


@pytest.fixture(scope="session", autouse=True)
def forkserver_running():
    """Start multiprocessing's forkserver before the per-test leak checks begin.

    The forkserver (and the ``pymp-*`` directory holding its socket) belongs to
    the interpreter and lives until it exits, like the resource tracker.
    """
    _env.warm_up()
