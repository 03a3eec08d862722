"""The README stays a front door whose commands CI can read and whose code matches the package.

Every call of a public nbtools name in the README's Python blocks binds to that name's real
signature, so a renamed or removed argument fails here instead of misleading a reader.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _public() -> dict[str, object]:
    from nbtools import distributed
    from nbtools.checkpoint import CheckpointManager
    from nbtools.data import DataLoader, VolumeDataset
    from nbtools.launch import RankPool
    from nbtools.monitor import GPUPane

    names: dict[str, object] = {
        "distributed": distributed,
        "CheckpointManager": CheckpointManager,
        "VolumeDataset": VolumeDataset,
        "DataLoader": DataLoader,
        "RankPool": RankPool,
        "GPUPane": GPUPane,
        # The README's variables, by the class the example gives them.
        "ckpt.restore": CheckpointManager.restore,
        "ckpt.maybe_save": CheckpointManager.maybe_save,
    }
    try:
        from nbtools.tracking import MlflowLogger
    except ImportError:  # mlflow not installed
        return names
    names.update(
        {
            "MlflowLogger": MlflowLogger,
            "log.log_metric": MlflowLogger.log_metric,
            "log.close": MlflowLogger.close,
        }
    )
    return names


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def _called(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def test_every_call_of_a_public_name_in_the_readme_binds_to_its_signature():
    public = _public()
    checked = []
    for block in _python_blocks():
        for node in ast.walk(ast.parse(block)):
            if not isinstance(node, ast.Call) or _called(node) not in public:
                continue
            target = public[_called(node)]
            signature = inspect.signature(target)  # type: ignore[arg-type]
            args = [None] * len(node.args)
            if _called(node).count(".") == 1:
                args = [None, *args]  # self
            kwargs = {kw.arg: None for kw in node.keywords if kw.arg is not None}
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:
                pytest.fail(f"README line `{ast.unparse(node)}` does not fit {signature}: {exc}")
            checked.append(_called(node))
    assert {"distributed", "CheckpointManager", "VolumeDataset", "DataLoader"} <= set(checked)


def test_ci_reads_the_test_command_and_the_readme_stays_short():
    awk = "/<!-- test-command -->/{getline; while ($0 ~ /^```/) getline; print; exit}"
    command = subprocess.run(
        ["awk", awk, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert command.startswith('pip install torch==2.13.0 -e ".[test]" && python -m pytest'), command
    assert "--durations=25" in command and "notebooks" in command
    assert "<!-- demo-command -->" in README
    lines = README.splitlines()
    assert len(lines) <= 170, len(lines)
    assert max(map(len, lines)) <= 300
