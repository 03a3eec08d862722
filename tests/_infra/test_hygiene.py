"""The leak fixtures themselves must catch leaks (checked in a pytest subprocess).

One pytest run over a test file per kind of leak and a clean one; each test
below reads its file's outcome from that run's report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

#: One pytest session in a subprocess over five test files: over 5 s on a small machine.
pytestmark = pytest.mark.slow

LEAKY = {
    "process": "import subprocess\ndef test_x():\n    subprocess.Popen(['sleep', '30'])\n",
    "thread": "import threading, time\ndef test_x():\n    threading.Thread(target=time.sleep, args=(6,), name='worker').start()\n",
    "env": "import os\ndef test_x():\n    os.environ['NBTOOLS_LEAKED'] = '1'\n",
    "tempfile": "import tempfile\ndef test_x():\n    tempfile.mkstemp()\n",
}
CLEAN = "def test_x(tmp_path):\n    (tmp_path / 'a').write_text('x')\n"


def _copy_conftest(root) -> None:
    """The session's conftest and the leak checks it imports, beside the tests written here."""
    tests = __file__.replace("_infra/test_hygiene.py", "")
    for name in ("conftest.py", "_leaks.py"):
        (root / name).write_text(open(tests + name).read())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, str]:
    """Each written test file's outcome line (``PASSED``/``FAILED``/``ERROR`` and the reason)."""
    root = tmp_path_factory.mktemp("hygiene")
    _copy_conftest(root)
    for kind, code in LEAKY.items():
        (root / f"test_leak_{kind}.py").write_text(textwrap.dedent(code))
    (root / "test_clean.py").write_text(CLEAN)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        # Only the conftest under test; the leaked process is sure to outlive a short grace.
        env={
            **os.environ,
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "NBTOOLS_TESTS_PROCESS_GRACE_S": "2",
        },
    )
    lines: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        match = re.match(r"(PASSED|FAILED|ERROR) (test_\w+)\.py::test_x\b(.*)", line)
        if match:
            lines.setdefault(match[2], "")
            lines[match[2]] += f"{match[1]}{match[3]}\n"
    assert len(lines) == len(LEAKY) + 1, proc.stdout + proc.stderr
    return lines


@pytest.mark.parametrize("kind", sorted(LEAKY))
def test_fixture_fails_a_leaking_test(kind, report):
    outcome = report[f"test_leak_{kind}"]
    assert "ERROR - Failed: LEAK in" in outcome, outcome  # its teardown reports the leak


def test_fixture_passes_a_clean_test(report):
    assert report["test_clean"] == "PASSED\n", report["test_clean"]
