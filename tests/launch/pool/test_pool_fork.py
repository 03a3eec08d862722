"""A process forked from the kernel leaves the kernel's pools alone, whatever it does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys
    from nbtools.launch import RankPool, distributed

    pool = RankPool(processes=2, output="none")
    pool.push(x=5)
    report = {"pids": pool.pids, "dir": pool._run_dir}

    def child_work():
        pass  # a library's worker: it does its job and returns

    # A bare fork whose child exits normally (its exit hooks run).
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
    report["after_fork"] = pool.pull("x")

    # A fork through multiprocessing; the child also asks for a shutdown of its own.
    def shut():
        distributed.shutdown()

    for target in (child_work, shut):
        worker = multiprocessing.get_context("fork").Process(target=target)
        worker.start()
        worker.join()
        report.setdefault("codes", []).append(worker.exitcode)
    report["after_mp"] = pool.execute("x + 1")
    report["dir_kept"] = os.path.isdir(report["dir"])

    # A child cannot drive the kernel's ranks: it is told so, and nothing changes here.
    pid = os.fork()
    if pid == 0:
        try:
            pool.execute("1")
        except Exception as exc:
            os._exit(0 if "forked" in str(exc) else 3)
        os._exit(4)
    report["child_call"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    report["after_child_call"] = pool.pull("x")
    print(json.dumps(report))
    sys.stdout.flush()
""")


@pytest.mark.slow
def test_a_forked_child_that_exits_leaves_the_parents_pool_running(tmp_path):
    script = tmp_path / "forking_kernel.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["after_fork"] == [5, 5]
    assert report["codes"] == [0, 0]
    assert report["after_mp"] == [6, 6]
    assert report["dir_kept"]
    assert report["child_call"] == 0
    assert report["after_child_call"] == [5, 5]
    # The parent's own exit still stops its ranks and removes its files.
    assert not os.path.exists(report["dir"])
    for pid in report["pids"]:
        assert (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )
