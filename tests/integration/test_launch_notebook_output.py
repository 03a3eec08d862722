"""Progress bars of two ranks as a real notebook saves them (nbclient runs a kernel)."""

from __future__ import annotations

import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELL = """
from nbtools import distributed

@distributed(processes=2)
def bars():
    import sys
    import time

    import torch.distributed as dist
    from tqdm import tqdm

    for _ in tqdm(range(30), desc="epoch", mininterval=0, file=sys.stderr):
        time.sleep(0.01)
        for _ in tqdm(range(3), desc="eval", position=1, leave=False, mininterval=0,
                      file=sys.stderr):
            pass
    print("done", dist.get_rank())
    return dist.get_rank()

bars.distributed()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cell's outputs as a saved notebook keeps them, by whether the client coalesces
    streams: the cell runs twice in one kernel (a warm second call), once each way."""
    nb = nbformat.v4.new_notebook()
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path_factory.mktemp("notebook"))}},
    )
    found = {}
    with client.setup_kernel():
        for coalesce in (False, True):
            client.coalesce_streams = coalesce
            cell = nbformat.v4.new_code_cell(CELL)
            nb.cells.append(cell)
            client.execute_cell(cell, len(nb.cells) - 1)
            streams = {}
            for output in cell.outputs:
                if output.output_type == "stream":
                    streams[output.name] = streams.get(output.name, "") + output.text
            found[coalesce] = streams, cell.outputs
    return found


def test_progress_bars_of_two_ranks_read_cleanly_in_a_saved_notebook(runs):
    streams, outputs = runs[True]
    assert any(
        o.output_type == "execute_result" and "[0, 1]" in o.data["text/plain"] for o in outputs
    )
    # Each rank's line whole and prefixed once; the two ranks finish in either order.
    assert sorted(streams["stdout"].splitlines()) == ["[rank 0] done 0", "[rank 1] done 1"]
    lines = streams["stderr"].splitlines()
    assert "\x1b[" not in streams["stderr"]
    # One finished bar per rank, each line with exactly one prefix, no fragments.
    assert len(lines) == 2, lines
    assert sorted(line[:9] for line in lines) == ["[rank 0] ", "[rank 1] "]
    for line in lines:
        assert re.fullmatch(r"\[rank [01]\] epoch: 100%\|█+\| 30/30 .*", line.rstrip()), line


def test_only_rank0_bar_updates_reach_the_notebook(runs):
    streams, _ = runs[False]
    updates = re.findall(r"\[rank (\d)\][^\n\r]*\r", streams["stderr"])
    assert updates and set(updates) == {"0"}
