"""The code of the troubleshooting and migration pages runs as pasted, in a real Jupyter kernel.

Each page's ``python`` blocks run in order, one cell per block, in a fresh kernel per page
whose working directory is a temporary one. A block that cannot run on a CPU machine says so
on the line before its fence (``<!-- not-run: reason -->``) and is not run. On a machine without
CUDA, ``gpus=N`` in a block runs as ``processes=N``, as the block's own comment tells a reader
without GPUs to write.
"""

from __future__ import annotations

import re

import pytest
from _doc_blocks import Block, blocks, run_in_kernel

PAGES = [
    "troubleshooting.md",
    "migration/accelerate.md",
    "migration/torchrun.md",
    "migration/ray-train.md",
]
_GPUS = re.compile(r"\bgpus=(\d+)")


def python_blocks(page: str) -> list[Block]:
    """The ``python`` blocks of ``page``, in order."""
    return [block for block in blocks(page) if block.lang == "python"]


def test_each_migration_page_runs_its_nbtools_example():
    for page in PAGES[1:]:
        found = python_blocks(page)
        assert len(found) == 2, f"{page}: a before and an after block"
        assert found[0].not_run, f"{page}: the code being replaced is marked not-run"


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_python_blocks_run_in_a_kernel(page, tmp_path):
    import torch

    cuda = torch.cuda.is_available()
    rewrite = None if cuda else (lambda source: _GPUS.sub(r"processes=\1", source))
    run_in_kernel(page, python_blocks(page), tmp_path, rewrite)
