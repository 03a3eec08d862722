"""A session that leaves files in the checkout fails, naming them (pytest in a throwaway git repo).

The repo gets the project's root ``conftest.py`` and ``tests/_infra/checkout_guard.py``, as in a
fresh clone, and test files that write into the checkout, into git-ignored paths, or only
under their temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WRITES_INTO_CHECKOUT = """\
import pathlib
ROOT = pathlib.Path(__file__).resolve().parents[1]
def test_writes():
    (ROOT / "left_behind.db").write_text("x")
    (ROOT / "tracked.txt").write_text("changed")
"""
WRITES_IGNORED_AND_TMP = """\
import pathlib
ROOT = pathlib.Path(__file__).resolve().parents[1]
def test_writes(tmp_path):
    (ROOT / "cache.ignored").write_text("x")
    (tmp_path / "out").write_text("x")
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _clone_like(tmp_path: Path, test_code: str) -> Path:
    """A committed repo with the guard, one test file and an already-dirty file."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "tests" / "_infra").mkdir(parents=True)
    shutil.copy(ROOT / "conftest.py", repo / "conftest.py")
    shutil.copy(ROOT / "tests" / "_infra" / "checkout_guard.py", repo / "tests" / "_infra")
    (repo / ".gitignore").write_text("*.ignored\n__pycache__/\n")
    (repo / "tracked.txt").write_text("committed")
    (repo / "tests" / "test_x.py").write_text(test_code)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    (repo / "dirty_before.txt").write_text("a developer's work in progress")
    return repo


def _pytest(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NBTOOLS_TESTS"))}
    # Only the plugins a test names: every other one costs seconds of imports per process.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "tests"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_session_that_writes_into_the_checkout_fails_naming_the_files(tmp_path):
    proc = _pytest(_clone_like(tmp_path, WRITES_INTO_CHECKOUT))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "LEAK: the test session left files in the checkout" in proc.stderr
    assert "?? left_behind.db" in proc.stderr and "M tracked.txt" in proc.stderr
    assert "dirty_before.txt" not in proc.stderr  # uncommitted before the session: not the tests'


def test_ignored_files_and_temporary_directories_do_not_count(tmp_path):
    proc = _pytest(_clone_like(tmp_path, WRITES_IGNORED_AND_TMP))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LEAK" not in proc.stderr


def test_with_xdist_workers_the_controller_checks_once(tmp_path):
    pytest.importorskip("xdist")
    proc = _pytest(_clone_like(tmp_path, WRITES_INTO_CHECKOUT), "-p", "xdist.plugin", "-n", "2")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert proc.stderr.count("LEAK: the test session left files in the checkout") == 1
    assert "?? left_behind.db" in proc.stderr
