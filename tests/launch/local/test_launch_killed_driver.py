"""A launching process that ends by a signal leaves nothing: ranks, forkserver, snapshots, files.

Each test runs a plain script using ``@distributed`` whose ranks train with
memory snapshots, and ends the script as a scheduler or a user would:
``timeout -s TERM``, SIGHUP, SIGKILL, or Ctrl+C while a rank is SIGSTOPped.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from nbtools.launch._rank import _leftovers

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from nbtools import distributed

    @distributed(processes=2, output="none")
    def train(root, marks):
        import torch
        from nbtools.checkpoint import CheckpointManager

        sleeper = subprocess.Popen(["sleep", "600"])  # in the rank's process group
        net = torch.nn.Linear(32, 32)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with CheckpointManager(root, every=1000, memory_every=1, async_save=False) as ckpt:
            step = ckpt.restore(model=net, optimizer=opt)
            while True:
                ckpt.maybe_save(step, model=net, optimizer=opt)
                step += 1
                if step == 3:
                    path = os.path.join(marks, os.environ["RANK"])
                    with open(path + ".tmp", "w") as fh:
                        fh.write(f"{os.getpid()} {sleeper.pid}")
                    os.replace(path + ".tmp", path)
                time.sleep(0.02)

    if __name__ == "__main__":
        try:
            train.distributed(sys.argv[1], sys.argv[2])
        except KeyboardInterrupt:
            from nbtools.launch._rank import _leftovers

            pids = [int(p) for r in "01" for p in open(os.path.join(sys.argv[2], r)).read().split()]
            running = [p for p in pids if not _leftovers.ending(p)]
            print("interrupted; still running:", running, flush=True)
    """
)


@pytest.fixture
def short_tmp():
    """A directory with a short path: the forkserver's socket lives in its TMPDIR."""
    path = tempfile.mkdtemp(prefix="nbk-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _ready(marks, proc: subprocess.Popen) -> list[int]:
    """Wait until both ranks have snapshotted; the pids of the ranks and their children."""
    deadline = time.monotonic() + 120
    while not all((marks / r).exists() for r in "01"):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "the ranks never reached step 3"
        time.sleep(0.1)
    return [int(p) for r in "01" for p in (marks / r).read_text().split()]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for proc in procs:
        try:
            if proc.is_running() and not _leftovers.ending(proc.pid):
                left.append(f"{proc.pid}: {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            continue
    return left


def _left(short_tmp, procs: list[psutil.Process]) -> list[str]:
    """What of the launch is still there: processes, snapshot files, temporary files."""
    files = [str(p) for p in (short_tmp / "shm").rglob("*")]
    files += [str(p) for p in (short_tmp / "tmp").iterdir()]
    return _running(procs) + files


def _start(short_tmp, wrapper: list[str]) -> subprocess.Popen:
    for name in ("shm", "tmp", "marks"):
        (short_tmp / name).mkdir()
    script = short_tmp / "train.py"
    script.write_text(_SCRIPT)
    env = dict(
        os.environ,
        TMPDIR=str(short_tmp / "tmp"),
        NBTOOLS_SNAPSHOT_DIR=str(short_tmp / "shm"),
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    command = [
        *wrapper,
        sys.executable,
        str(script),
        str(short_tmp / "root"),
        str(short_tmp / "marks"),
    ]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _nothing_left_within_10_s(short_tmp, procs: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 10
    left = _left(short_tmp, procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _left(short_tmp, procs)
    for proc in procs:  # whatever the outcome, this test leaves nothing either
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert left == []


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_a_driver_ended_by_timeout_leaves_no_process_snapshot_or_file(short_tmp):
    # timeout(1) sends its signal when its alarm fires: SIGALRM fires it now.
    proc = _start(short_tmp, ["timeout", "-s", "TERM", "600"])
    try:
        _ready(short_tmp / "marks", proc)
        driver = psutil.Process(proc.pid).children()[0]
        procs = [driver, *_tree(driver.pid)]
        assert any(f.suffix == ".slot" for f in (short_tmp / "shm").rglob("*"))
        proc.send_signal(signal.SIGALRM)
        proc.wait(timeout=60)
        assert proc.returncode == 124  # timeout's own code: the command timed out
        _nothing_left_within_10_s(short_tmp, procs)
    finally:
        _end(proc)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGKILL])
def test_a_driver_ended_by_a_signal_leaves_no_process_snapshot_or_file(short_tmp, signum):
    proc = _start(short_tmp, [])
    try:
        _ready(short_tmp / "marks", proc)
        procs = [psutil.Process(proc.pid), *_tree(proc.pid)]
        assert len(procs) >= 6  # driver, forkserver, resource tracker, 2 ranks, 2 sleepers
        assert any(f.suffix == ".slot" for f in (short_tmp / "shm").rglob("*"))
        proc.send_signal(signum)
        proc.wait(timeout=60)
        assert proc.returncode == -signum  # ended by the signal, as without nbtools
        _nothing_left_within_10_s(short_tmp, procs)
    finally:
        _end(proc)


def test_an_interrupt_with_a_stopped_rank_returns_once_every_rank_process_is_gone(short_tmp):
    proc = _start(short_tmp, [])
    try:
        rank0, sleeper0, rank1, sleeper1 = _ready(short_tmp / "marks", proc)
        os.killpg(rank1, signal.SIGSTOP)  # rank 1 and what it started
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        # Checked by the script itself the moment the call raised KeyboardInterrupt.
        assert "interrupted; still running: []" in out
        assert all(_leftovers.ending(p) for p in (rank0, sleeper0, rank1, sleeper1))
    finally:
        _end(proc)
