"""The dependency direction of DESIGN.md: worker-side imports pull in no front end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRONT_ENDS = ("IPython", "ipywidgets", "plotly", "mlflow")


def _imported_after(code: str) -> list[str]:
    probe = (
        code
        + "\nimport json, sys\n"
        + f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRONT_ENDS!r})))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_packages_import_no_front_end():
    code = "\n".join(
        [
            "import nbtools",
            "import nbtools.runtime, nbtools.errors",
            "import nbtools.launch",
            "import nbtools.checkpoint",
            "import nbtools.data",
            "import nbtools.monitor",
            "from nbtools import distributed, DistributedError",
            "from nbtools.checkpoint import CheckpointManager, VolumeWriter, VolumeReader, find_latest_valid",
            "from nbtools.data import VolumeDataset, DataLoader",
        ]
    )
    assert _imported_after(code) == []


def test_import_nbtools_is_lazy():
    probe = "import nbtools, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("front", ["nbtools.monitor.pane", "nbtools.magics", "nbtools.tracking"])
def test_front_end_modules_do_load_their_libraries(front):
    # The check above is meaningful only if the front ends really are where those imports live.
    assert _imported_after(f"import {front}") != []


def test_ruff_bans_front_end_imports_in_core(tmp_path):
    ruff = pytest.importorskip("ruff")
    del ruff
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bad = root / "nbtools" / "data" / "_layering_probe.py"
    bad.write_text("import plotly  # noqa: F401\n")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251", str(bad)],
            capture_output=True, text=True, cwd=root, timeout=60,
        )
    finally:
        bad.unlink()
    assert out.returncode != 0
    assert "TID251" in out.stdout
