"""A spare rank parked ahead of need: the dead rank's replacement is a process that was
already running, its imports done, when the rank died.

The training function is defined in ``__main__``, as a notebook cell defines it, in a
script run by the test. Its ranks look at the forkserver's children (their own parent's)
for a process that is not one of them: the spare. The launcher parks one once the group
has formed and the forkserver holds its preloads; the script makes a first call to let
it load them, as a notebook's later calls find it.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow]

CELL = r"""
import json, multiprocessing.forkserver, os, signal, sys, time
import psutil
import torch
import torch.distributed as dist
from nbtools import distributed
from nbtools.launch._local import _forkserver
from nbtools.runtime import get_restart_count


def spares(ranks):
    # The forkserver's children that are not ranks of this group.
    return sorted(p.pid for p in psutil.Process(os.getppid()).children() if p.pid not in ranks)


def await_spare(ranks, other=None, within=60.0):
    deadline = time.time() + within
    while time.time() < deadline:
        found = [pid for pid in spares(ranks) if pid != other]
        if found:
            return found[0]
        time.sleep(0.05)
    return None


def train(base, case):
    rank, world, attempt = dist.get_rank(), dist.get_world_size(), get_restart_count()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    weight = torch.ones(3) * (rank + 1)
    if attempt == 0:
        if rank == 0:
            seen = {"ranks": pids}
            if case["expect_spare"]:
                seen["spare"] = await_spare(pids)
                if case["kill_spare"] and seen["spare"]:
                    # A spare that dies by itself is replaced by another.
                    os.kill(seen["spare"], signal.SIGKILL)
                    seen["killed_spare"] = seen["spare"]
                    seen["spare"] = await_spare(pids, other=seen["spare"])
            else:
                time.sleep(3.0)  # longer than a spare takes to be parked
                seen["others"] = spares(pids)
            with open(f"{base}/seen.json", "w") as fh:
                json.dump(seen, fh)
        dist.barrier()
        if case["kill"] and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(weight)
    return {"pid": os.getpid(), "attempt": attempt, "sum": weight.tolist()}


base, case = sys.argv[1], json.loads(sys.argv[2])
distributed(processes=2, output="none")(lambda: None).distributed()  # the forkserver starts
deadline = time.time() + 120
while not _forkserver.ready() and time.time() < deadline:
    time.sleep(0.1)
job = distributed(
    processes=4, max_restarts=case["restarts"], heal=case["heal"], output="none"
)(train)
out = {"results": job.distributed(base, case)}
with open(f"{base}/seen.json") as fh:
    out["seen"] = json.load(fh)
# Nothing of the call stays with the forkserver: its ranks and its spare have ended.
server = psutil.Process(multiprocessing.forkserver._forkserver._forkserver_pid)
deadline = time.time() + 10
while server.children() and time.time() < deadline:
    time.sleep(0.05)
out["left"] = [p.pid for p in server.children()]
print("RESULT " + json.dumps(out))
"""


_TIMEOUT_S = 300


def test_the_replacement_of_a_dead_rank_is_the_spare_parked_before_it_died(run_cell):
    result = run_cell(
        CELL, _TIMEOUT_S, restarts=2, heal=True, kill=True, kill_spare=True, expect_spare=True
    )
    seen, results = result["seen"], result["results"]
    # The spare killed first was replaced by another, which then took rank 2's place.
    assert seen["spare"] is not None and seen["spare"] != seen["killed_spare"], seen
    assert results[2]["pid"] == seen["spare"], (seen, results)
    for rank in (0, 1, 3):
        assert results[rank]["pid"] == seen["ranks"][rank], (seen, results)
    assert [r["attempt"] for r in results] == [1] * 4
    assert all(r["sum"] == [10.0] * 3 for r in results), results  # ranks 1 + 2 + 3 + 4
    assert "healed in" in result["output"], result["output"][-3000:]
    assert result["left"] == [], result  # the spare parked after the heal ended with the call


@pytest.mark.parametrize(
    ("restarts", "heal"), [(0, True), (1, False)], ids=["no-restarts", "no-heal"]
)
def test_no_spare_is_parked_where_the_group_cannot_heal(run_cell, restarts, heal):
    result = run_cell(
        CELL,
        _TIMEOUT_S,
        restarts=restarts,
        heal=heal,
        kill=False,
        kill_spare=False,
        expect_spare=False,
    )
    assert result["seen"]["others"] == [], result["seen"]
    assert [r["pid"] for r in result["results"]] == result["seen"]["ranks"]
    assert result["left"] == [], result
