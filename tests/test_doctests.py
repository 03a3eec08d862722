"""The examples in the package's docstrings run as written, where they need no ranks.

An example that needs ranks, a cluster, a GPU, a kernel or files the reader must make first says
``# doctest: +SKIP`` on its lines; every other example runs here, in this process, with the
module's own namespace, as ``pytest --doctest-modules`` would run it.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil

import pytest

import nbtools


def _modules() -> list[str]:
    names = ["nbtools"]
    for info in pkgutil.walk_packages(nbtools.__path__, "nbtools."):
        names.append(info.name)
    return sorted(names)


def _with_examples() -> list[str]:
    """The modules whose source holds an example (read as text: nothing is imported here)."""
    found = []
    for name in _modules():
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py"):
            with open(origin, encoding="utf-8") as fh:
                if ">>>" in fh.read():
                    found.append(name)
    return found


MODULES = _with_examples()


def test_the_package_has_examples_to_run():
    assert len(MODULES) >= 20, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_run_as_written(name):
    environ = dict(os.environ)
    module = importlib.import_module(name)
    # A library's own import may set variables (lightning sets PYTORCH_NVML_BASED_CUDA_CHECK):
    # that is its doing, not the examples', and the rest of this process must not see it.
    os.environ.clear()
    os.environ.update(environ)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures = []
    for test in finder.find(module, name, globs=dict(vars(module))):
        if test.filename is not None and not test.filename.endswith(module.__file__ or ""):
            continue  # a name imported from elsewhere is tested where it is defined
        report: list[str] = []
        result = runner.run(test, out=report.append, clear_globs=True)
        if result.failed:
            failures.append("".join(report))
    assert not failures, "\n".join(failures)
