"""Kept pools, distributed.shutdown(), and the end of the kernel: nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nbtools.launch import RankPool, distributed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_keep_alive_calls_reuse_the_ranks_until_shutdown():
    @distributed(processes=2, keep_alive=True, output="none")
    def where(x):
        import os

        import torch
        import torch.distributed as dist

        t = torch.ones(1) * x
        dist.all_reduce(t)
        return os.getpid(), t.item()

    try:
        first = where.distributed(1)
        second = where.distributed(2)
        assert [r[1] for r in first] == [2.0, 2.0] and [r[1] for r in second] == [4.0, 4.0]
        pids = [r[0] for r in first]
        assert [r[0] for r in second] == pids  # the same processes served both calls
    finally:
        distributed.shutdown()
    assert _gone(pids)
    third = where.distributed(1)  # a new pool after shutdown
    try:
        assert {r[0] for r in third}.isdisjoint(pids)
    finally:
        distributed.shutdown()


@pytest.mark.slow
def test_keep_alive_runs_the_call_again_after_a_failure_up_to_max_restarts():
    @distributed(processes=2, keep_alive=True, max_restarts=1, output="none")
    def flaky(marker):
        import os

        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return "ok"

    marker = os.path.join(os.environ["TMPDIR"], "flaky-marker")
    try:
        assert flaky.distributed(marker) == ["ok", "ok"]
    finally:
        distributed.shutdown()
        os.unlink(marker)


@pytest.mark.slow
def test_shutdown_closes_every_open_pool():
    pool = RankPool(processes=1, output="none")
    pids = pool.pids
    distributed.shutdown()
    assert pool.closed
    assert _gone(pids)


def test_keep_alive_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_alive"):
        distributed(processes=1, keep_alive="yes")


SCRIPT = textwrap.dedent("""
    import json, sys
    from nbtools.launch import RankPool

    pool = RankPool(processes=2, output="none")
    pool.execute("import torch, torch.distributed as dist\\nbase = 10")

    def total(x):                       # defined in __main__, as in a notebook cell
        global calls
        calls = globals().get("calls", 0) + 1
        t = torch.ones(1) * (base + x)  # base and torch live on the ranks
        dist.all_reduce(t)
        return t.item(), calls

    helper_value = 7
    def uses_helper():
        return helper_value * 2        # a notebook name the ranks do not have

    first, second = pool.run(total, 1), pool.run(total, 2)
    print(json.dumps({"first": first, "second": second, "helper": pool.run(uses_helper),
                      "pids": pool.pids, "dir": pool._run_dir}))
    sys.stdout.flush()
    # No close(): the end of the interpreter (of the kernel) stops the ranks.
""")


@pytest.mark.slow
def test_notebook_functions_see_rank_globals_and_the_exit_leaves_nothing(tmp_path):
    script = tmp_path / "notebook_like.py"
    script.write_text(SCRIPT)
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["first"] == [[22.0, 1], [22.0, 1]]
    assert report["second"] == [[24.0, 2], [24.0, 2]]
    assert report["helper"] == [14, 14]
    assert _gone(report["pids"])
    assert not os.path.exists(report["dir"])
    assert not {e for e in set(os.listdir("/dev/shm")) - shm_before if not e.startswith("sem.")}
