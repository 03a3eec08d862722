"""In a real kernel: a ``%%distributed`` session and a ``RankPool`` survive a SIGKILLed rank.

The survivors keep their processes and the names their cells made; the replaced rank
starts with a new namespace, and the cell says which names were lost there.
"""

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
    "%distributed start --processes 3",
    "%%distributed\nimport torch\nimport torch.distributed as dist\n"
    "w = torch.full((2,), float(dist.get_rank()))\nsteps = 5",
    "import json, os, signal\n"
    "pool = get_ipython().magics_manager.registry['DistributedMagics'].pool\n"
    "before = list(pool.pids)\n"
    "os.kill(before[1], signal.SIGKILL)\n"
    "print(json.dumps(before))",
    "%%distributed\nsteps + 1",
    "print(json.dumps(list(pool.pids)))",
    "%%distributed\nimport torch\nimport torch.distributed as dist\n"
    "t = torch.ones(1)\ndist.all_reduce(t)\n(int(t.item()), 'w' in globals(), 'steps' in globals())",
    "from nbtools.launch import RankPool\n"
    "rp = RankPool(processes=2, output='none')\n"
    "rp.execute('x = 41')\n"
    "rp_before = rp.pids\n"
    "os.kill(rp_before[0], signal.SIGKILL)\n"
    "try:\n"
    "    rp.execute('x')\n"
    "except Exception as exc:\n"
    "    print(type(exc).__name__ + ': ' + str(exc).splitlines()[0])\n"
    "print(json.dumps([rp.pids[0] != rp_before[0], rp.pids[1] == rp_before[1], "
    "rp.execute(\"globals().get('x')\")]))\n"
    "rp.close()",
    "%distributed stop",
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


def test_a_session_and_a_pool_heal_a_killed_rank_and_keep_the_survivors_names(tmp_path):
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
    shown = [_text(cell) for cell in cells]
    # Only the cell the death cut short fails.
    errors = [i for i, cell in enumerate(cells) if _text(cell, ("error",))]
    assert errors == [4], shown
    before = json.loads(_text(cells[3], ("stream",)))
    assert "rank 1 died (SIGKILL); healed in" in shown[4], shown[4]
    assert "ranks 0, 2 kept their processes and names, rank 1 replaced" in shown[4], shown[4]
    assert "the names lost there (its namespace is new): steps, w" in shown[4], shown[4]
    after = json.loads(_text(cells[5], ("stream",)))
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    # The replacement is in the survivors' group; only they still have their names.
    assert "[rank 0] (3, True, True)" in shown[6], shown[6]
    assert "[rank 1] (3, False, False)" in shown[6], shown[6]
    assert "[rank 2] (3, True, True)" in shown[6], shown[6]
    # A RankPool made in a cell heals the same way.
    lines = _text(cells[7], ("stream",)).strip().splitlines()
    errors = [line for line in lines if line.startswith("DistributedError: ")]
    assert errors and errors[0].startswith("DistributedError: rank 0 died (SIGKILL); healed in")
    assert json.loads(lines[-1]) == [True, True, [None, 41]], lines
    assert "stopped 3 ranks" in shown[8], shown
    deadline = time.monotonic() + 10
    pids = set(before) | set(after)
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if psutil.pid_exists(pid)], pids
