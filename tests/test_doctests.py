"""The examples in the package's docstrings run as written, where they need no ranks.

An example that needs ranks, a cluster, a GPU, a kernel or files the reader must make first says
``# doctest: +SKIP`` on its lines; every other example runs here, with the module's own
namespace, as ``pytest --doctest-modules`` would run it. They run in a process of their own:
importing every module brings in the trainers and MLflow, which the test process's forkserver
would otherwise preload into every rank it starts later.
"""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys

import pytest

import nbtools

_RUN = """
import doctest, importlib, json, sys

failures = {}
ran = 0
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs=dict(vars(module))):
        if test.filename != module.__file__:
            continue  # a name imported from elsewhere is run where it is defined
        report = []
        result = runner.run(test, out=report.append, clear_globs=True)
        ran += result.attempted
        if result.failed:
            failures.setdefault(name, []).append("".join(report))
print(json.dumps({"ran": ran, "failures": failures}))
"""


def _with_examples() -> list[str]:
    """The modules whose source holds an example (read as text: nothing is imported here)."""
    found = []
    names = ["nbtools"] + [m.name for m in pkgutil.walk_packages(nbtools.__path__, "nbtools.")]
    for name in sorted(names):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py"):
            with open(origin, encoding="utf-8") as fh:
                if ">>>" in fh.read():
                    found.append(name)
    return found


@pytest.mark.slow
def test_the_docstring_examples_run_as_written():
    modules = _with_examples()
    assert len(modules) >= 20, modules
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(modules)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["ran"] >= 20, outcome
    assert not outcome["failures"], "\n".join(
        f"--- {name}\n" + "\n".join(reports) for name, reports in outcome["failures"].items()
    )
