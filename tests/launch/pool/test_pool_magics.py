"""``%distributed`` / ``%%distributed``: IPython's shell for bad input, a real kernel for the rest."""

from __future__ import annotations

import json
import time

import psutil
import pytest
from IPython.core.error import UsageError

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def test_a_cell_without_a_pool_is_one_clear_line(ip):
    with pytest.raises(UsageError, match="no pool is running: start one with %distributed start"):
        ip.run_cell_magic("distributed", "", "x = 1")
    with pytest.raises(UsageError, match="no pool is running"):
        ip.run_line_magic("distributed", "pull x")
    with pytest.raises(UsageError, match="Usage"):
        ip.run_line_magic("distributed", "begin")
    with pytest.raises(
        UsageError, match="--rich-output.*'every'.*choose from 'rank0', 'all', 'none'"
    ):
        ip.run_line_magic("distributed", "start --processes 1 --rich-output every")


def test_bad_input_to_a_running_pool_is_one_clear_line(ip, capsys):
    ip.run_line_magic("distributed", "start --processes 2 --output none")
    with pytest.raises(UsageError, match="already running with other options"):
        ip.run_line_magic("distributed", "start --processes 3")
    ip.run_line_magic("distributed", "start --processes 2 --output none")  # the same: no-op
    with pytest.raises(UsageError, match="'nope' is not defined on ranks 0, 1"):
        ip.run_line_magic("distributed", "pull nope")
    with pytest.raises(UsageError, match="no variable 'absent' in the notebook"):
        ip.run_line_magic("distributed", "push absent")
    ip.user_ns["lock"] = __import__("threading").Lock()
    with pytest.raises(UsageError, match="'lock'.*cannot be sent"):
        ip.run_line_magic("distributed", "push lock")
    with pytest.raises(SyntaxError):
        ip.run_cell_magic("distributed", "", "def broken(:")
    ip.user_ns["lr"] = 0.5
    ip.run_line_magic("distributed", "push lr")
    assert ip.run_line_magic("distributed", "pull lr") == [0.5, 0.5]
    ip.run_line_magic("distributed", "status")
    status = capsys.readouterr().out
    assert "uptime" in status and "memory (RSS)" in status
    lines = status.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert [line.split()[0] for line in lines[header + 1 : header + 3]] == ["0", "1"]


NOTEBOOK = [
    "%load_ext nbtools",
    "%distributed start --processes 2",
    "%%distributed\nimport torch\nimport torch.distributed as dist\n"
    "t = torch.ones(2) * (dist.get_rank() + 1)\nprint('made', t.tolist())",
    "%%distributed\ndist.all_reduce(t)\nt.sum()",
    "pulled = %distributed pull t\nimport json\nprint(json.dumps([v.tolist() for v in pulled]))",
    "%distributed status",
    "import json, os\nprint(json.dumps(get_ipython().magics_manager.registry"
    "['DistributedMagics'].pool.pids))",
    "%distributed stop",
    "%%distributed\nt",
]


def _outputs(cell, kind: str = "stream") -> str:
    text = ""
    for output in cell.outputs:
        if output.output_type == "stream" and kind == "stream":
            text += output.text
        elif output.output_type in ("display_data", "execute_result") and kind == "display":
            text += output.data.get("text/plain", "") + "\n"
        elif output.output_type == "error" and kind == "error":
            text += output.ename + ": " + output.evalue
    return text


def test_cells_on_a_pool_in_a_real_kernel(tmp_path):
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
    cells = nb.cells
    assert "started 2 ranks" in _outputs(cells[1], "display")
    lines = sorted(_outputs(cells[2]).splitlines())  # ranks print at the same time
    assert lines == ["[rank 0] made [1.0, 1.0]", "[rank 1] made [2.0, 2.0]"]
    assert _outputs(cells[3], "display").splitlines() == [
        "[rank 0] tensor(6.)",
        "[rank 1] tensor(6.)",
    ]
    assert json.loads(_outputs(cells[4])) == [[3.0, 3.0], [3.0, 3.0]]
    status = _outputs(cells[5], "display")
    assert "uptime" in status and "RankPool 2 ranks" in status
    pids = json.loads(_outputs(cells[6]))
    assert "stopped 2 ranks" in _outputs(cells[7], "display")
    assert "UsageError: no pool is running" in _outputs(cells[8])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_shutting_the_kernel_down_stops_the_ranks(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(source)
        for source in (
            "%load_ext nbtools",
            "%distributed start --processes 2",
            "import json\nfrom nbtools.launch import RankPool\npool = RankPool(processes=1)\n"
            "pool.execute('import torch\\nkept = torch.ones(3)')\n"
            "print(json.dumps({'pids': pool.pids + get_ipython().magics_manager.registry"
            "['DistributedMagics'].pool.pids, 'dir': pool._run_dir}))",
        )
    ]
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # shuts the kernel down at the end, as closing a notebook does
    report = json.loads(_outputs(nb.cells[2]))
    import os

    # The ranks end, and the pool's directory goes: with the kernel's exit handlers, else
    # with the ranks (they watch the kernel) or the forkserver (it ends what it started).
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
        any(psutil.pid_exists(p) for p in report["pids"]) or os.path.exists(report["dir"])
    ):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(pid) for pid in report["pids"])
    assert not os.path.exists(report["dir"])
