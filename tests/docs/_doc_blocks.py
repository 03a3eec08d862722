"""The docs' fenced code blocks, and running a page's blocks in a real Jupyter kernel as pasted.

A page's blocks are read in order, indented ones (inside list items) included. A block that
cannot run on a CPU machine says so in the markdown, on the line before its fence::

    <!-- not-run: needs 8 GPUs -->

:func:`run_in_kernel` runs blocks one cell per block, in order, in a fresh kernel whose
working directory is a temporary one, as a reader pastes them into a new notebook.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["DOCS", "RUN", "Block", "blocks", "missing_modules", "run_in_kernel"]

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Languages of the blocks that run: Python and IPython's magics.
RUN = {"python", "ipython", "ipython3"}
#: An opening fence: a language (``python``) or a MyST directive (``{image} path``), or neither.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\{[\w:-]+\}|[\w+-]*)(?:[ \t].*)?$")
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(?P<reason>.+?)\s*-->")


@dataclass
class Block:
    """One fenced code block of a page."""

    page: str  # relative to docs/
    line: int  # of the opening fence, counted from 1
    lang: str
    source: str  # dedented as far as the fence is indented
    not_run: str | None  # the reason the page gives, when it gives one

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``docs/<page>`` in order, indented ones (inside list items) included."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = len(opening["indent"])
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
        before = next((line for line in reversed(lines[:index]) if line.strip()), "")
        reason = _NOT_RUN.search(before)
        found.append(
            Block(page, index + 1, opening["lang"], body, reason["reason"] if reason else None)
        )
        index = end + 1
    return found


def missing_modules(found: Iterable[Block]) -> list[str]:
    """Top-level modules the blocks import that are not installed here (an extra not installed)."""
    import ast
    import importlib.util

    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    names = set()
    for block in found:
        for node in ast.walk(ast.parse(transform(block.source))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


def run_in_kernel(
    page: str,
    cells: list[Block],
    tmp_path: Path,
    rewrite: Callable[[str], str] | None = None,
) -> None:
    """Run ``cells`` of ``page`` in order in a fresh kernel; fail naming the first that fails.

    Blocks marked not-run are skipped (the test is skipped when none is left), as is a page
    whose blocks import a module that is not installed here. ``rewrite`` changes a block's
    source before it runs, as the page's own comments tell a reader on this machine to.
    """
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    runnable = [block for block in cells if block.not_run is None]
    if not runnable:
        reasons = sorted({block.not_run for block in cells if block.not_run})
        pytest.skip(f"{page}: no block runs here ({'; '.join(reasons) or 'no code'})")
    missing = missing_modules(runnable)
    if missing:
        pytest.skip(f"{page} needs {', '.join(missing)} (pip install -e '.[test]')")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    env.pop("MLFLOW_TRACKING_URI", None)  # as a reader's: MLflow's default store, here in cwd
    env["NBTOOLS_CACHE_DIR"] = str(tmp_path / "cache")  # the dataset cache, not ~/.cache
    with client.setup_kernel(env=env, cwd=str(tmp_path)):
        for block in runnable:
            source = rewrite(block.source) if rewrite else block.source
            cell = nbformat.v4.new_code_cell(source)
            nb.cells.append(cell)
            try:
                client.execute_cell(cell, len(nb.cells) - 1)
            except nbclient.exceptions.CellExecutionError as exc:
                pytest.fail(f"{block} fails as pasted:\n{source}\n{exc}")
    skipped = [f"{block} ({block.not_run})" for block in cells if block.not_run]
    if skipped:
        print("not run here:", "; ".join(skipped))
