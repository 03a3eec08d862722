"""The code of the troubleshooting and migration pages runs as pasted, in a real Jupyter kernel.

Each page's ``python`` blocks run in order, one cell per block, in a fresh kernel per page
whose working directory is a temporary one. A block that cannot run on a CPU machine says so
on the line before its fence (``<!-- not-run: reason -->``) and is not run. On a machine without
CUDA, ``gpus=N`` in a block runs as ``processes=N``, as the block's own comment tells a reader
without GPUs to write.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = [
    "troubleshooting.md",
    "migration/accelerate.md",
    "migration/torchrun.md",
    "migration/ray-train.md",
]
_BLOCK = re.compile(
    r"(?:<!--\s*not-run:\s*(?P<reason>.+?)\s*-->\n)?"
    r"^(?P<indent>[ ]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$",
    re.S | re.M,
)
_GPUS = re.compile(r"\bgpus=(\d+)")


def python_blocks(page: str) -> list[tuple[str, str | None]]:
    """``(source, reason not to run it or None)`` for each ``python`` block of ``page``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return [
        (textwrap.dedent(m["body"]), m["reason"])
        for m in _BLOCK.finditer(text)
        if m["lang"] == "python"
    ]


def test_each_migration_page_runs_its_nbtools_example():
    for page in PAGES[1:]:
        blocks = python_blocks(page)
        assert len(blocks) == 2, f"{page}: a before and an after block"
        assert blocks[0][1], f"{page}: the code being replaced is marked not-run"


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_python_blocks_run_in_a_kernel(page, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    import torch

    runnable = [source for source, reason in python_blocks(page) if reason is None]
    if not runnable:
        pytest.skip(f"{page}: every block needs what this machine lacks")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    env["NBTOOLS_CACHE_DIR"] = str(tmp_path / "cache")
    with client.setup_kernel(env=env, cwd=str(tmp_path)):
        for source in runnable:
            if not torch.cuda.is_available():
                source = _GPUS.sub(r"processes=\1", source)
            cell = nbformat.v4.new_code_cell(source)
            nb.cells.append(cell)
            try:
                client.execute_cell(cell, len(nb.cells) - 1)
            except nbclient.exceptions.CellExecutionError as exc:
                pytest.fail(f"{page}: a block fails as pasted:\n{source}\n{exc}")
