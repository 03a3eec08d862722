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


# A module-level decorator in a script that also uses spawn/forkserver pools, and in a
# module whose dataset spawn loader workers import inside a rank: each child imports the
# module again while it bootstraps, where starting a process is refused.
HELPERS = textwrap.dedent(
    """
    import torch
    from torch.utils.data import Dataset
    from nbtools import distributed

    class Squares(Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return torch.tensor(float(i * i))

    @distributed(processes=2)
    def load():
        from torch.utils.data import DataLoader
        loader = DataLoader(Squares(), batch_size=2, num_workers=2,
                            multiprocessing_context="spawn")
        return sorted(float(x) for batch in loader for x in batch)
    """
)

POOLS = textwrap.dedent(
    """
    import multiprocessing as mp
    import helpers
    from nbtools import distributed

    @distributed(processes=2)
    def world():
        import torch.distributed as dist
        return dist.get_world_size()

    if __name__ == "__main__":
        with mp.get_context("spawn").Pool(2) as pool:
            print("SPAWN", pool.map(abs, [-1, -2]), flush=True)
        with mp.get_context("forkserver").Pool(2) as pool:
            print("FORKSERVER", pool.map(abs, [-3, -4]), flush=True)
        print("RANKS", world.distributed(), flush=True)
        print("LOADED", helpers.load.distributed()[0], flush=True)
    """
)


def test_decorating_in_a_script_with_spawn_children_starts_nothing_in_them(tmp_path):
    (tmp_path / "helpers.py").write_text(HELPERS)
    script = tmp_path / "pools.py"
    script.write_text(POOLS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "bootstrapping phase" not in out
    assert "SPAWN [1, 2]" in proc.stdout and "FORKSERVER [3, 4]" in proc.stdout, out
    assert "RANKS [2, 2]" in proc.stdout, out
    assert "LOADED [0.0, 1.0, 4.0, 9.0]" in proc.stdout, out
