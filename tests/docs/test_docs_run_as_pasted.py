"""Every code block of getting started and the guides runs as pasted, in a real Jupyter kernel.

A page's ``python`` blocks are its cells: each runs in order, one cell per block, in a
fresh kernel per page whose working directory is a temporary one, as a reader pastes
them into a new notebook. A block that cannot run on a CPU machine says so in the
markdown, on the line before its fence::

    <!-- not-run: needs 8 GPUs -->

and is skipped here with that reason. ``bash`` blocks (installs, the CLI) are not run.
"""

from __future__ import annotations

import pytest
from _doc_blocks import DOCS, RUN, Block, blocks, run_in_kernel

PAGES = [
    "getting-started.md",
    *sorted(f"guides/{p.name}" for p in (DOCS / "guides").glob("*.md")),
]


def _cells(page: str) -> list[Block]:
    return [block for block in blocks(page) if block.lang in RUN]


def test_every_page_has_blocks_and_every_block_names_its_language():
    for page in PAGES:
        found = blocks(page)
        unnamed = [str(b) for b in found if not b.lang]
        assert not unnamed, f"blocks without a language (python, bash, ...): {unnamed}"
    assert all(_cells(page) for page in ("getting-started.md", "guides/checkpointing.md"))


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


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_blocks_run_in_order_in_a_kernel(page, tmp_path):
    run_in_kernel(page, _cells(page), tmp_path)
