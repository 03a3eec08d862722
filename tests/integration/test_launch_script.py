"""@distributed from a plain script without a ``__main__`` guard runs the top level once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil

SCRIPT = textwrap.dedent(
    """
    import sys
    from nbtools import DistributedError, distributed

    print("TOP LEVEL RAN", flush=True)  # no if __name__ == "__main__": guard on purpose

    class Scale:
        def __init__(self, factor):
            self.factor = factor

    def helper(x):
        return x + 1

    scale = Scale(3)

    @distributed(processes=2)
    def work(x):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(helper(x))])
        dist.all_reduce(t)
        return t.item() * scale.factor

    print("RESULT", work.distributed(1), flush=True)

    @distributed(processes=2)
    def broken():
        raise KeyError("missing")

    try:
        broken.distributed()
    except DistributedError as exc:
        print("ERROR", str(exc).splitlines()[0], flush=True)
    """
)


def test_unguarded_script_runs_its_top_level_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("TOP LEVEL RAN") == 1, proc.stdout
    assert "RESULT [12.0, 12.0]" in proc.stdout
    assert "ERROR rank 0 failed: KeyError: 'missing'" in proc.stdout or (
        "ERROR rank 1 failed: KeyError: 'missing'" in proc.stdout
    ), proc.stdout


ORPHANING = textwrap.dedent(
    """
    import os, sys, time
    from nbtools import distributed

    @distributed(processes=2)
    def linger(pid_dir):
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        time.sleep(600)

    linger.distributed(sys.argv[1])
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ranks_and_helpers_end_when_the_caller_is_killed(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(ORPHANING)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    caller = subprocess.Popen([sys.executable, str(script), str(pid_dir)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline:
            assert caller.poll() is None, "the caller ended before its ranks started"
            time.sleep(0.1)
        descendants = psutil.Process(caller.pid).children(recursive=True)
        assert len(os.listdir(pid_dir)) == 2
    finally:
        caller.kill()  # like a kernel that dies: no exit handlers run
        caller.wait()
    # The ranks and the forkserver are now orphans; they must end by themselves.
    pids = [p.pid for p in descendants] + [int(name) for name in os.listdir(pid_dir)]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:
        psutil.Process(pid).kill()
    assert not survivors
