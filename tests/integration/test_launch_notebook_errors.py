"""A rank's error as a saved notebook shows it: the user's frames and cells, not the launcher's."""

from __future__ import annotations

import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

DEFINE = """
from nbtools import distributed

def check(x):
    if x > 1:
        raise ValueError(f"x is {x}")
    return x

@distributed(processes=2, output="none")
def train(x):
    return check(x + 1)
"""

CALL = "train.distributed(1)"


def test_an_uncaught_rank_error_shows_cells_and_no_launcher_frames(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(DEFINE), nbformat.v4.new_code_cell(CALL)]
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    (error,) = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "DistributedError"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    # The kernel-side frames: the user's call, none of nbtools' own modules.
    assert "Cell In[2], line 1, in <module>" in text, text
    assert text.startswith("Traceback (most recent call last):\n  Cell In[2], line 1"), text
    assert "_api.py" not in text and "_runner.py" not in text, text
    # The rank's frames name the cell that defined the code, as IPython would.
    assert "Cell In[1], line 10, in train" in text, text
    assert "Cell In[1], line 5, in check" in text, text
    assert "ipykernel_" not in text, text
    assert "ValueError: x is 2" in text
