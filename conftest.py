"""Hooks for the example notebooks under ``pytest --nbmake`` (``tests/conftest.py`` covers
``tests/`` only: pytest applies a conftest's hooks to the items below it).

Notebook 06 runs on the Ray tests' cluster (``tests/ray/_ray_cluster.py``) instead of
starting one of its own: its kernel inherits ``RAY_ADDRESS``, as on a real cluster. One
cluster per test process, never two starting at once on a small machine.
"""

from __future__ import annotations

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


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _is_ray_notebook(item):
        os.environ.pop("RAY_ADDRESS", None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the cluster if notebook 06 alone started it (the Ray tests' fixture stops its own)."""
    module = sys.modules.get("_ray_cluster")
    if module is not None:
        module.stop()


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
