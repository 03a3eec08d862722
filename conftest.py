"""Hooks for the example notebooks under ``pytest --nbmake`` (``tests/conftest.py`` covers
``tests/`` only: pytest applies a conftest's hooks to the items below it).

Notebook 06 runs on the Ray tests' cluster (``tests/ray/_ray_cluster.py``) instead of
starting one of its own: its kernel inherits ``RAY_ADDRESS``, as on a real cluster. One
cluster per test process, never two starting at once on a small machine.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import sys
from types import ModuleType

import pytest

#: The notebook that runs on the test cluster (``tests/conftest.py`` groups it with tests/ray).
RAY_NOTEBOOK = "notebooks/06_multinode_ray.ipynb"


def _ray_cluster_module() -> ModuleType:
    """``tests/ray/_ray_cluster.py``, the same module object the Ray tests' conftest imports."""
    module = sys.modules.get("_ray_cluster")
    if module is None:
        path = os.path.join(os.path.dirname(__file__), "tests", "ray", "_ray_cluster.py")
        spec = importlib.util.spec_from_file_location("_ray_cluster", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["_ray_cluster"] = module
        spec.loader.exec_module(module)
    return module


def _is_ray_notebook(item: pytest.Item) -> bool:
    return item.nodeid.split("::", 1)[0] == RAY_NOTEBOOK


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _is_ray_notebook(item):
        os.environ["RAY_ADDRESS"] = _ray_cluster_module().shared().address


def _uses_ray_cluster(item: pytest.Item) -> bool:
    path = item.nodeid.split("::", 1)[0]
    return path.startswith("tests/ray/") or path == RAY_NOTEBOOK


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the item's fixtures are torn down: stop the Ray cluster when the next test does
    not use it (the tests that do run one after another: they are one xdist group)."""
    if _is_ray_notebook(item):
        os.environ.pop("RAY_ADDRESS", None)
    if _uses_ray_cluster(item) and (nextitem is None or not _uses_ray_cluster(nextitem)):
        module = sys.modules.get("_ray_cluster")
        if module is not None:
            module.stop()


#: How long a test process may take from the start of its session's end (the last fixtures'
#: teardown, the hooks) to its exit, before it prints every thread's stack and exits failing:
#: a hang there is outside every test's timeout and would otherwise stall the run for good.
_SESSION_END_S = float(os.environ.get("NBTOOLS_TESTS_SESSION_END_S", "300"))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Bound the session's end (:data:`_SESSION_END_S`), then stop the Ray cluster if the
    session ended inside the tests that use it."""
    _arm_session_end(session.config)
    module = sys.modules.get("_ray_cluster")
    if module is not None:
        module.stop()


def _arm_session_end(config: pytest.Config) -> None:
    """Dump every thread's stack to the real stderr and exit 1 if this process is still alive
    :data:`_SESSION_END_S` from now (the output capture holds fd 2 here: take a copy of the
    terminal's while it is suspended)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=False)
    try:
        stream = os.fdopen(os.dup(2), "w")
    finally:
        if capman is not None:
            capman.resume_global_capture()
    stream.write("")  # opened now, while fd 2 is the terminal's
    config.stash[_END_STREAM] = stream  # kept open until the process exits
    faulthandler.dump_traceback_later(_SESSION_END_S, exit=True, file=stream)


_END_STREAM = pytest.StashKey[object]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """An xdist worker's session has ended here: what follows is its wait for the controller,
    which ends it when every worker is done (and kills it 10 s later if it has not exited)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and _END_STREAM in config.stash:
        faulthandler.cancel_dump_traceback_later()


def _infra_module(name: str) -> ModuleType | None:
    """``tests/_infra/<name>.py``, or None where the tests are not there."""
    path = os.path.join(os.path.dirname(__file__), "tests", "_infra", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_nbtools_{name}", path)
    if spec is None or spec.loader is None or not os.path.exists(path):
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """With ``-n N`` and no ``--dist`` given, distribute by groups (``tests/conftest.py`` makes
    them), in the order ``tests/_infra/group_order.py`` gives, not xdist's by number of tests."""
    args = config.invocation_params.args
    if not any(arg == "--dist" or arg.startswith("--dist=") for arg in args):
        if os.environ.get("PYTEST_XDIST_WORKER"):
            # Workers are configured from the command line, which names no --dist.
            config.option.loadgroup = True
        elif getattr(config.option, "numprocesses", None):
            config.option.dist = "loadgroup"
    if getattr(config.option, "dist", None) == "loadgroup" and "--loadscope-reorder" not in args:
        config.option.loadscopereorder = False


def pytest_configure(config: pytest.Config) -> None:
    """The session ends with a check that it left the checkout as it found it
    (``tests/_infra/checkout_guard.py``); with xdist, the longest groups go first
    (``tests/_infra/group_order.py``)."""
    guard = _infra_module("checkout_guard")
    if guard is not None:
        config.pluginmanager.register(
            guard.CheckoutGuard(os.path.dirname(__file__)), "nbtools-checkout-guard"
        )
    order = _infra_module("group_order")
    if order is not None:
        config.pluginmanager.register(order.GroupOrder(config), "nbtools-group-order")


#: Lanes. The fast lane is ``-m "not slow and not kernel and not cluster and not browser and not
#: integration"``: unit tests only. Tests are marked here by where they live (files may mark
#: themselves too): what starts a Jupyter kernel, a Ray cluster or a browser, and the multi-process
#: runs of tests/integration.
_LANE_MARKS = (
    ("notebooks/", "kernel"),
    ("notebooks/06_multinode_ray.ipynb", "cluster"),
    ("tests/integration/", "integration"),
    ("tests/integration/test_launch_notebook_", "kernel"),
    ("tests/integration/test_mlflow_ranks.py", "kernel"),
    ("tests/integration/test_reference_samples.py", "kernel"),
    ("tests/integration/test_user_code_", "kernel"),
    ("tests/monitor/test_monitor_saved.py", "kernel"),
    ("tests/launch/pool/test_pool_magics.py", "kernel"),
    ("tests/ray/", "cluster"),
    ("tests/browser/", "browser"),
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the lanes its location puts it in (see ``_LANE_MARKS``)."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for prefix, mark in _LANE_MARKS:
            if path.startswith(prefix):
                item.add_marker(mark)
