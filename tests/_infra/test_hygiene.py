"""The leak fixtures themselves must catch leaks (checked in a pytest subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

LEAKY = {
    "process": "import subprocess\ndef test_x():\n    subprocess.Popen(['sleep', '30'])\n",
    "thread": "import threading, time\ndef test_x():\n    threading.Thread(target=time.sleep, args=(6,), name='worker').start()\n",
    "env": "import os\ndef test_x():\n    os.environ['NBTOOLS_LEAKED'] = '1'\n",
    "tempfile": "import tempfile\ndef test_x():\n    tempfile.mkstemp()\n",
}


def _copy_conftest(tmp_path) -> None:
    """The session's conftest and the leak checks it imports, beside a test written here."""
    tests = __file__.replace("_infra/test_hygiene.py", "")
    for name in ("conftest.py", "_leaks.py"):
        (tmp_path / name).write_text(open(tests + name).read())


@pytest.mark.parametrize("kind", sorted(LEAKY))
def test_fixture_fails_a_leaking_test(kind, tmp_path):
    _copy_conftest(tmp_path)
    (tmp_path / "test_leak.py").write_text(textwrap.dedent(LEAKY[kind]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode != 0, proc.stdout
    assert "LEAK in" in proc.stdout, proc.stdout


def test_fixture_passes_a_clean_test(tmp_path):
    _copy_conftest(tmp_path)
    (tmp_path / "test_clean.py").write_text("def test_x(tmp_path):\n    (tmp_path / 'a').write_text('x')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
