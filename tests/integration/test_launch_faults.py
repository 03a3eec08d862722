"""Faults inside ranks: early exits, leftovers, nesting, lost peers, hangs, huge messages."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import psutil
import pytest
from _launch_watch import Watch, forkserver_running  # noqa: F401 - the fixture applies here

from nbtools.errors import DistributedError
from nbtools.launch import distributed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_rank_that_exits_with_code_0_before_returning_is_a_failure_and_restarts():
    @distributed(processes=2, max_restarts=1, output="none")
    def leaves_early():
        import time

        import torch
        import torch.distributed as dist

        from nbtools.runtime import get_restart_count

        if dist.get_rank() == 1 and get_restart_count() == 0:
            os._exit(0)
        if dist.get_rank() == 0 and get_restart_count() == 0:
            time.sleep(600)  # a peer that keeps running: the call must not wait for it
        dist.all_reduce(torch.ones(1))
        return get_restart_count()

    assert leaves_early.distributed() == [1, 1]

    @distributed(processes=2, output="none")
    def always_leaves_early():
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(0)
        time.sleep(600)

    with pytest.raises(DistributedError, match="^rank 1 exited with code 0 before returning"):
        always_leaves_early.distributed()


def test_what_a_rank_leaves_running_is_stopped_and_named(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, output="none")
    def leaves_processes(pid_dir):
        import multiprocessing
        import subprocess
        import time

        import torch.distributed as dist

        def linger():  # defined here: only a forked child can run it
            time.sleep(1000)

        rank = dist.get_rank()
        child = multiprocessing.Process(target=linger)  # not a daemon: exit would wait for it
        child.start()
        sleeper = subprocess.Popen(["sleep", "1000"])
        for name, pid in (("process", child.pid), ("popen", sleeper.pid)):
            with open(os.path.join(pid_dir, f"{name}-{rank}-{pid}"), "w"):
                pass
        return rank

    assert leaves_processes.distributed(str(tmp_path)) == [0, 1]
    pids = [int(name.rsplit("-", 1)[1]) for name in os.listdir(tmp_path)]
    assert len(pids) == 4 and not [pid for pid in pids if _alive(pid)]
    warnings = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert all("'sleep 1000'" in text and "forked Python child" in text for text in warnings)


def test_a_nested_launch_is_refused_inside_the_rank_and_the_launcher_stays_usable():
    @distributed(processes=2, output="none")
    def inner():
        return 1

    @distributed(processes=2, output="none")
    def outer():
        return inner.distributed()

    with pytest.raises(DistributedError, match="launches do not nest") as info:
        outer.distributed()
    assert info.value.failures[0].exc_type == "nbtools.errors.LaunchError"
    assert outer() == [1, 1]  # the in-process call launches as usual
    assert inner.distributed() == [1, 1]


def test_a_peer_that_returned_is_named_when_the_other_waits_in_a_collective():
    @distributed(processes=2, output="none")
    def returns_early():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            return "done"
        dist.all_reduce(torch.ones(1))
        return "unreachable"

    with pytest.raises(DistributedError) as info:
        returns_early.distributed()
    assert str(info.value).startswith("rank 1 returned while rank 0 was in all_reduce")
    assert info.value.failures[0].collective == "all_reduce"


def test_a_rank_that_raises_is_the_cause_not_the_peer_the_launcher_stopped():
    @distributed(processes=2, output="none")
    def raises_while_the_peer_works():
        import time

        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise ValueError("boom on rank 0")
        time.sleep(60)  # not in a collective: stopped once rank 0 failed

    with pytest.raises(DistributedError) as info:
        raises_while_the_peer_works.distributed()
    assert str(info.value).startswith("rank 0 failed: ValueError: boom on rank 0"), str(info.value)
    assert list(info.value.failures) == [0]  # the stopped peer did not fail


@pytest.mark.usefixtures("sigint_default")
def test_interrupt_shows_every_ranks_stack_before_stopping_them(tmp_path, monkeypatch):
    @distributed(processes=2)
    def stuck():
        import time

        import torch
        import torch.distributed as dist

        print("ready", flush=True)
        if dist.get_rank() == 1:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))

    out = Watch(sys.stdout, "[rank 0] ready", "[rank 1] ready")
    err = Watch(sys.stderr, "never")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)

    def interrupt():
        if out.seen.wait(60):
            os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            stuck.distributed()
    finally:
        interrupter.join()
    lines = err.buffer.splitlines()
    assert any(line.startswith("[rank 0]") and "in all_reduce" in line for line in lines), lines
    assert any(line.startswith("[rank 1]") and "in stuck" in line for line in lines), lines


def test_hang_timeout_prints_every_stack_once_and_the_call_goes_on(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")
    go = tmp_path / "go"

    @distributed(processes=2, hang_timeout=1.0)
    def waits_for_the_caller(path):
        import time

        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            while not os.path.exists(path):  # the caller releases it once it saw the stacks
                time.sleep(0.05)
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    err = Watch(sys.stderr, "[rank 0] ", "in all_reduce", "[rank 1] ", "in waits_for_the_caller")
    monkeypatch.setattr(sys, "stderr", err)

    def release():
        err.seen.wait(120)
        go.touch()

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        assert waits_for_the_caller.distributed(str(go)) == [2.0, 2.0]
    finally:
        go.touch()
        releaser.join()
    assert err.seen.is_set()
    assert sum("hang_timeout" in r.getMessage() for r in caplog.records) == 1
    frames = [line for line in err.buffer.splitlines() if "in waits_for_the_caller" in line]
    assert frames and all("<dynamic-code>" not in line for line in frames), frames
    assert any(line.startswith("[rank 1]") and f'File "{__file__}"' in line for line in frames), (
        frames
    )
    assert "[rank 1]     time.sleep(0.05)" in err.buffer  # the source line under the frame


def test_a_huge_exception_message_is_cut_in_the_text_and_kept_on_the_failure():
    @distributed(processes=2, output="none")
    def shouts():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("x" * 20_000_000)
        return 0

    with pytest.raises(DistributedError) as info:
        shouts.distributed()
    text = str(info.value)
    assert len(text) < 100_000
    assert "DistributedError.failures[1].message" in text
    assert len(info.value.failures[1].message) == 20_000_000


def test_processes_of_ranks_stopped_after_a_failure_raise_no_advice(tmp_path, caplog):
    # nbtools stops the group when a rank fails; what the other rank started ends with
    # it, and the user's code did nothing the leftover advice could mend.
    caplog.set_level(logging.DEBUG, logger="nbtools")

    @distributed(processes=2, output="none")
    def fails_while_a_child_runs(marker):
        import subprocess
        import time

        import torch.distributed as dist

        subprocess.Popen(["sleep", "1000"])
        open(f"{marker}-{dist.get_rank()}", "w").close()
        if dist.get_rank() == 1:
            while not os.path.exists(f"{marker}-0"):
                time.sleep(0.05)
            raise ValueError("boom")
        time.sleep(1000)

    with pytest.raises(DistributedError, match="ValueError"):
        fails_while_a_child_runs.distributed(str(tmp_path / "up"))
    left = [r for r in caplog.records if "sleep 1000" in r.getMessage()]
    assert left, "the stopped ranks' child was not found and stopped"
    assert all(r.levelno < logging.WARNING for r in left), [r.getMessage() for r in left]
    assert not any("End what a rank starts" in r.getMessage() for r in caplog.records)


def test_a_librarys_per_process_service_is_stopped_without_advice(tmp_path, caplog):
    # W&B starts ``wandb-core`` per process and ends it at interpreter exit, after
    # ``run.finish()``; a rank is stopped before its interpreter exits, so nbtools ends it.
    # A stand-in of the same name plays it here; a plain leftover still gets the advice.
    caplog.set_level(logging.DEBUG, logger="nbtools")
    service = tmp_path / "wandb-core"
    service.write_text('#!/bin/bash\nexec -a "$0" sleep 1000\n')  # keeps its name
    service.chmod(0o755)

    @distributed(processes=2, output="none")
    def uses_a_service(path):
        import subprocess

        subprocess.Popen([path, "--port-filename", "/dev/null"])
        return 1

    assert uses_a_service.distributed(str(service)) == [1, 1]
    stopped = [r for r in caplog.records if "wandb-core" in r.getMessage()]
    assert stopped, "the service was not found and stopped"
    assert all(r.levelno < logging.WARNING for r in stopped), [r.getMessage() for r in stopped]
    assert not any("End what a rank starts" in r.getMessage() for r in caplog.records)
