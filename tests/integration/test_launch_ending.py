"""Ranks that end: seen as soon as they run no more code, collected in the background."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from _launch_watch import forkserver_running  # noqa: F401 - the fixture applies here

from nbtools import events
from nbtools.errors import DistributedError
from nbtools.launch import distributed
from nbtools.launch._rank import _leftovers

_HOLDS_A_GIB = """
import sys, threading, time
block = bytearray(2**30)
for i in range(0, len(block), 4096):
    block[i] = 1  # every page touched: the kernel has a GiB to release at the end
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
if sys.argv[1].startswith("exit"):
    sys.exit(int(sys.argv[1][4:]))
time.sleep(600)
"""


def _ended_code(proc: subprocess.Popen) -> int | None:
    """Poll until the process reads as ending; its exit code as read then (None: never)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _leftovers.ending(proc.pid):
            return _leftovers.exit_code(proc.pid)
        time.sleep(0.001)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code"),
    [("kill", -signal.SIGKILL), ("term", -signal.SIGTERM), ("exit3", 3), ("exit0", 0)],
)
def test_a_process_holding_a_gib_reads_as_ended_with_its_exit_code_before_it_is_reaped(how, code):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_A_GIB, how], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert not _leftovers.ending(proc.pid)
        assert _leftovers.exit_code(proc.pid) is None  # still running: nothing to read
        if how == "kill":
            proc.send_signal(signal.SIGKILL)
        elif how == "term":
            proc.send_signal(signal.SIGTERM)
        assert _ended_code(proc) == code  # read from /proc, not from a reaped status
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == code
    assert _leftovers.ending(proc.pid)  # gone for good
    assert _leftovers.exit_code(proc.pid) is None


def _collectors() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbtools-collect-ranks"]


@pytest.mark.slow
def test_a_rank_killed_holding_a_gib_is_named_and_every_rank_is_collected_by_the_end(tmp_path):
    @distributed(processes=3, max_restarts=1, output="none")
    def killed_with_a_gib(pids_dir):
        import os

        import torch
        import torch.distributed as dist

        from nbtools.runtime import get_restart_count

        rank, attempt = dist.get_rank(), get_restart_count()
        with open(os.path.join(pids_dir, f"{attempt}-{rank}"), "w") as fh:
            fh.write(str(os.getpid()))
        block = torch.ones(2**28)  # a GiB of float32, every page written
        dist.barrier()
        if attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(block[:1])  # the others wait here for the killed rank
        return attempt

    since = time.time()
    assert killed_with_a_gib.distributed(str(tmp_path)) == [1, 1, 1]
    failed = [e.message for e in events.log(since=since, kinds=["rank_failed"])]
    assert failed and failed[0].startswith("rank 1 failed: the process was killed by SIGKILL")
    assert not _collectors()  # the launch waited for the first attempt's ranks
    for name in sorted(p.name for p in tmp_path.iterdir()):
        assert not psutil.pid_exists(int((tmp_path / name).read_text())), name


@pytest.mark.slow
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_and_not_named_as_a_cause():
    @distributed(processes=2, output="none")
    def one_dies_one_ignores_sigterm():
        import os
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            dist.barrier()
            time.sleep(600)
        dist.barrier()  # rank 1 ignores SIGTERM from here on
        os._exit(3)  # dies without a word: its peer is stopped at once

    with pytest.raises(DistributedError) as info:
        one_dies_one_ignores_sigterm.distributed()
    assert str(info.value).startswith("rank 0 failed: the process exited with code 3"), str(
        info.value
    )
    assert list(info.value.failures) == [0]  # the rank stopped with SIGKILL did not fail
    assert not _collectors()
