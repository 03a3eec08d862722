"""A kept pool whose every call makes, uses and closes a manager grows by nothing."""

from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

CALLS, WARM_UP = 200, 10

# The cells a notebook user would run: a function kept on two ranks, called again and
# again; each call restores, trains and snapshots through a manager of its own.
CELLS = [
    """
import os
from nbtools import distributed

@distributed(processes=2, keep_alive=True, output="none")
def train(root):
    import os, threading
    import torch
    from nbtools.checkpoint import CheckpointManager

    net = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    with CheckpointManager(root, every=4, memory_every=2, replicas=1) as ckpt:
        start = ckpt.restore(model=net, optimizer=opt)
        for step in range(start, start + 4):
            opt.zero_grad()
            net(torch.ones(2, 64)).sum().backward()
            opt.step()
            ckpt.maybe_save(step, model=net, optimizer=opt)
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(fds), sockets, len(os.listdir("/proc/self/task")), rss
""",
    f"""
seen = [train.distributed(os.path.join(os.environ["NBTOOLS_TEST_ROOT"], f"run{{i}}"))
        for i in range({CALLS})]
""",
    "distributed.shutdown()",
    "import json\nprint(json.dumps(seen))",
]


def test_a_pool_making_a_manager_per_call_stays_flat(tmp_path, shm, monkeypatch):
    monkeypatch.setenv("NBTOOLS_TEST_ROOT", str(tmp_path))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    seen = json.loads(nb.cells[-1].outputs[0].text)
    assert len(seen) == CALLS
    for rank in range(2):
        warm = seen[WARM_UP - 1][rank]
        last = seen[-1][rank]
        # fds, sockets and threads: not one more after 190 calls; RSS: noise, not growth
        # (every leaked group was 10 fds, 4 sockets and 6 threads per call).
        assert last[:3] == warm[:3], (rank, warm, last)
        assert last[3] - warm[3] < 32 * 2**20, (rank, warm, last)
    assert not any(p.is_file() for p in shm.rglob("*"))  # every call closed cleanly
