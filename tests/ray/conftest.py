"""A real Ray cluster on this machine for the tests of ``cluster="ray"``.

One cluster for the tests that use it (``_ray_cluster``: starting one takes tens of
seconds on a small machine), shared with notebook 06 (see ``tests/conftest.py``).

``no_leaks`` is extended for Ray: Ray's own processes (raylets, idle
workers) belong to the cluster, not to a test, but a test that leaves an
nbtools actor alive, a placement group not removed, or such an actor's
process running fails.
"""

from __future__ import annotations

import os

import pytest

# Read when Ray is imported: without it every node binds to the machine's outward-facing
# address instead of the node_ip_address the test cluster gives.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "nbtools[ray]"')

import _ray_cluster  # noqa: E402
from _leaks import env_problems, process_group_problems  # noqa: E402
from _ray_helpers import our_processes, wait_until_clean  # noqa: E402


@pytest.fixture
def ray_cluster():
    """The session's local Ray cluster, with this process connected as its driver.

    Started on first use and kept while the session runs the tests that use it; the root
    ``conftest.py`` stops it when the session moves on to others (or ends).
    """
    cluster = _ray_cluster.shared()
    if not ray.is_initialized():
        with _ray_cluster.keeping_sigterm():  # not Ray's handler in later tests' forked children
            ray.init(address=cluster.address, log_to_driver=False)
    return cluster


@pytest.fixture(autouse=True)
def no_leaks(request):
    """The shared leak checks, minus Ray's own processes, plus actors and placement groups.

    Replaces the top-level ``no_leaks`` for these tests: the cluster's
    processes are this process's children and Ray starts and ends idle
    workers as it pleases.
    """
    import tempfile

    if "ray_cluster" in request.fixturenames:
        # Started (or joined) before the snapshot: the cluster's own variables (RAY_TMPDIR,
        # the driver's PYTHONBREAKPOINT) belong to it, and stop() removes them when it stops.
        request.getfixturevalue("ray_cluster")
    env_before = dict(os.environ)
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    yield
    # Ray's state is only asked about when the test used the cluster.
    problems = wait_until_clean() if "ray_cluster" in request.fixturenames else []
    new_tmp = sorted(
        e
        for e in set(os.listdir(tempfile.gettempdir())) - tmp_before
        if not e.startswith(("pytest-", "pymp-", "ray"))
    )
    if new_tmp:
        problems.append(f"temporary files left in {tempfile.gettempdir()}: {new_tmp[:10]}")
    for proc in our_processes():
        proc.kill()
    problems += env_problems(env_before, {"PYTEST_CURRENT_TEST"})
    problems += process_group_problems()
    import threading

    leftover = [t.name for t in threading.enumerate() if t.name.startswith("nbtools")]
    if leftover:
        problems.append(f"nbtools threads left running: {leftover}")
    if problems:
        pytest.fail("LEAK: " + "; ".join(problems), pytrace=False)
