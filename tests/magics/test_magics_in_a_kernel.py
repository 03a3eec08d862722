"""The magics as a notebook user types them, comments included, in a real kernel."""

from __future__ import annotations

import json
import time

import psutil
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

NOTEBOOK = [
    "%load_ext nbtools",
    "import json, psutil\nprint(json.dumps(sorted(' '.join(p.cmdline()) for p in "
    "psutil.Process().children())))",
    "%distributed start --processes 2     # or --gpus 8, --cluster ray, --max-restarts K",
    "%%distributed   # runs on every rank\nimport torch.distributed as dist\n"
    "loss = 2.5 - dist.get_rank()  # a per-rank value",
    "%distributed pull loss   # a list in the kernel, one value per rank",
    "import json\nprint(json.dumps(loss))",
    "pids = get_ipython().magics_manager.registry['DistributedMagics'].pool.pids\n"
    "print(json.dumps(list(pids)))",
    "%distributed status  # one row per rank",
    "%distributed stop  # nothing keeps running",
    "%gpu_pane --simulated 2   # no GPU needed\n%gpu_pane --close  # stops polling",
    "import torch\nmodel = torch.nn.Linear(2, 1)",
    "%%autoresume ckpt --every 2 --state model   # saves every 2 steps\n"
    "for step in range(start_step, 4):\n    checkpoint(step)",
]


def _text(cell, kinds=("stream", "display_data", "execute_result", "error")) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type not in kinds:
            continue
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}\n")
        else:
            parts.append(output.data.get("text/plain", "") + "\n")
    return "".join(parts)


def test_magics_take_a_trailing_comment_and_pull_binds_the_name_after_load_ext_warms_up(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in NOTEBOOK]
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [_text(cell, ("error",)) for cell in nb.cells if _text(cell, ("error",))]
    assert not errors, errors
    cells = nb.cells
    # %load_ext starts the forkserver that ranks start from, before any launch.
    children = json.loads(_text(cells[1], ("stream",)))
    assert any("forkserver" in cmdline for cmdline in children), children
    shown = [_text(cell) for cell in cells]
    assert "started 2 ranks" in shown[2], shown
    assert "loss is now a list in the notebook, one value per rank (2 ranks)" in shown[4], shown
    assert json.loads(_text(cells[5], ("stream",))) == [2.5, 1.5], shown
    pids = json.loads(_text(cells[6], ("stream",)))
    assert "uptime" in shown[7] and "stopped 2 ranks" in shown[8], shown
    assert "starting fresh with start_step = 0" in shown[11], shown
    assert "the cell finished; last saved step 3 under" in shown[11], shown
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if psutil.pid_exists(pid)], pids
