"""With xdist, the groups expected to take longest run first (pytest in a throwaway project).

The project gets the root ``conftest.py`` and ``tests/_infra/group_order.py``, as in a fresh
clone, and three groups of tests that write their names, in the order they run, into a file.
One worker (``-n 1``) runs the groups in the order they are handed out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: Two pytest sessions with an xdist worker each: seconds on a small machine.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

_TEST = """\
import os, time
import pytest
pytestmark = [pytest.mark.xdist_group({group!r}){extra}]
{tests}
"""
_ONE = """
def test_{name}():
    time.sleep({sleep})
    with open(os.environ["ORDER_LOG"], "a") as fh:
        fh.write("{name}\\n")
"""


def _write(path: Path, group: str, tests: dict[str, float], extra: str = "") -> None:
    body = "".join(_ONE.format(name=n, sleep=s) for n, s in tests.items())
    path.write_text(_TEST.format(group=group, extra=extra, tests=body))


@pytest.fixture
def project(tmp_path) -> Path:
    """Unit tests (``quick``), a test marked slow that is not (``marked``), and an unmarked
    test that takes a second and a half (``long``)."""
    pytest.importorskip("xdist")
    root = tmp_path / "project"
    (root / "tests" / "_infra").mkdir(parents=True)
    shutil.copy(ROOT / "conftest.py", root / "conftest.py")
    shutil.copy(ROOT / "tests" / "_infra" / "group_order.py", root / "tests" / "_infra")
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    _write(root / "tests" / "test_a_quick.py", "quick", {"q1": 0, "q2": 0})
    _write(root / "tests" / "test_b_long.py", "long", {"l": 1.5})
    _write(root / "tests" / "test_c_marked.py", "marked", {"m": 0}, ", pytest.mark.slow")
    return root


def _order(root: Path, *args: str) -> list[str]:
    """The tests' names in the order one xdist worker ran them."""
    log = root / "order.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NBTOOLS_TESTS"))}
    # Only the plugins the test needs: every other one costs seconds of imports per process.
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", ORDER_LOG=str(log))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "xdist.plugin", "-n", "1", *args, "tests"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().split()


def test_groups_run_longest_first_by_marks_then_by_the_last_run(project):
    # Nothing timed yet: a test marked slow is expected to take longest, then two unit
    # tests over one; a group's tests keep their order.
    assert _order(project) == ["m", "q1", "q2", "l"]
    # That run timed every test: now the group that took longest goes first, with
    # --dist loadgroup named too (as a user may), not xdist's order by number of tests.
    assert _order(project, "--dist", "loadgroup")[0] == "l"


def test_a_fresh_clone_orders_its_groups_by_the_committed_seconds(project):
    # No cache yet, as in CI's fresh clone: the committed table says the unit tests' group
    # took longest in the last whole run, and it goes first; a group it does not name is
    # estimated by its marks, as before.
    (project / "tests" / "_infra" / "group_seconds.json").write_text('{"quick": 30, "long": 20}')
    assert _order(project, "-p", "no:cacheprovider") == ["q1", "q2", "l", "m"]
