"""Every code block of getting started and the guides runs as pasted, in a real Jupyter kernel.

A page's ``python`` blocks are its cells: each runs in order, one cell per block, in a
fresh kernel per page whose working directory is a temporary one, as a reader pastes
them into a new notebook. A block that cannot run on a CPU machine says so in the
markdown, on the line before its fence::

    <!-- not-run: needs 8 GPUs -->

and is skipped here with that reason. ``bash`` blocks (installs, the CLI) are not run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = ["getting-started.md", *sorted(p.name for p in (DOCS / "guides").glob("*.md"))]
#: Languages of the blocks that run: Python and IPython's magics.
RUN = {"python", "ipython", "ipython3"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(?P<reason>.+?)\s*-->")


@dataclass
class Block:
    """One fenced code block of a page."""

    page: str
    line: int  # of the opening fence, counted from 1
    lang: str
    source: str
    not_run: str | None  # the reason the page gives, when it gives one

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _path(page: str) -> Path:
    return DOCS / page if page == "getting-started.md" else DOCS / "guides" / page


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` in order, indented ones (inside list items) included."""
    lines = _path(page).read_text().splitlines()
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
            Block(
                page,
                index + 1,
                opening["lang"],
                body,
                reason["reason"] if reason else None,
            )
        )
        index = end + 1
    return found


def _cells(page: str) -> list[Block]:
    return [block for block in blocks(page) if block.lang in RUN]


def test_every_page_has_blocks_and_every_block_names_its_language():
    for page in PAGES:
        found = blocks(page)
        unnamed = [str(b) for b in found if not b.lang]
        assert not unnamed, f"blocks without a language (python, bash, ...): {unnamed}"
    assert all(_cells(page) for page in ("getting-started.md", "checkpointing.md"))


def test_every_block_is_one_cell_as_ipython_reads_it():
    """A cell magic on any line but the first, or a syntax error, fails before a kernel starts."""
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    for page in PAGES:
        for block in _cells(page):
            lines = block.source.splitlines()
            late = [n for n, line in enumerate(lines[1:], 2) if line.lstrip().startswith("%%")]
            assert not late, f"{block}: a cell magic on line {late[0]} needs a block of its own"
            try:
                compile(transform(block.source), str(block), "exec")
            except SyntaxError as exc:
                pytest.fail(f"{block}: {exc}")


def _missing_modules(blocks: list[Block]) -> list[str]:
    """Top-level modules the blocks import that are not installed here (an extra not installed)."""
    import ast
    import importlib.util

    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    names = set()
    for block in blocks:
        for node in ast.walk(ast.parse(transform(block.source))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_blocks_run_in_order_in_a_kernel(page, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = _cells(page)
    runnable = [block for block in cells if block.not_run is None]
    if not runnable:
        reasons = sorted({block.not_run for block in cells if block.not_run})
        pytest.skip(f"{page}: no block runs here ({'; '.join(reasons) or 'no code'})")
    missing = _missing_modules(runnable)
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
    skipped = [f"{block} ({block.not_run})" for block in cells if block.not_run]
    with client.setup_kernel(env=env, cwd=str(tmp_path)):
        for block in runnable:
            cell = nbformat.v4.new_code_cell(block.source)
            nb.cells.append(cell)
            try:
                client.execute_cell(cell, len(nb.cells) - 1)
            except nbclient.exceptions.CellExecutionError as exc:
                pytest.fail(f"{block} fails as pasted:\n{block.source}\n{exc}")
    if skipped:
        print("not run here:", "; ".join(skipped))
