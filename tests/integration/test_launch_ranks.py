"""@distributed really launches 2 CPU ranks: results, environment, output, errors, restarts, interrupt."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
from _launch_watch import Watch, forkserver_running  # noqa: F401 - the fixture applies here

from nbtools.errors import DistributedError
from nbtools.launch import _env, distributed


def test_results_environment_group_and_loopback(capfd):
    offset = 100

    class Box:  # a class defined where the function is, like a notebook cell
        def __init__(self, value):
            self.value = value

    @distributed(processes=2)
    def probe(box, scale=lambda v: v * 10):
        import torch
        import torch.distributed as dist

        from nbtools import runtime

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"hello from {dist.get_rank()}")
        os.write(2, b"fd-level write\n")
        listening = {
            c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"
        }
        keys = [
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ]
        return {
            "env": {k: os.environ[k] for k in keys},
            "sum": t.item(),
            "backend": dist.get_backend(),
            "rank": runtime.get_rank(),
            "restart": runtime.get_restart_count(),
            "listening": listening,
            "value": scale(box.value) + offset,
        }

    results = probe.distributed(Box(4))
    assert [r["rank"] for r in results] == [0, 1]
    for rank, result in enumerate(results):
        env = result["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert result["sum"] == 3.0 and result["backend"] == "gloo"
        assert result["restart"] == 0 and result["value"] == 140
        assert result["listening"] and result["listening"] <= {"127.0.0.1", "::1"}
    out, err = capfd.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 1] fd-level write" in err


def test_output_streams_while_the_function_runs(tmp_path, monkeypatch):
    go = tmp_path / "go"

    @distributed(processes=2, output="rank0")
    def waits_for_the_caller(path):
        import time

        import torch.distributed as dist

        print("waiting", flush=True)
        for _ in range(600):  # the caller creates the file once it has seen the line
            if os.path.exists(path):
                return dist.get_rank()
            time.sleep(0.05)
        raise TimeoutError("the caller never saw the output while the ranks were running")

    watch = Watch(sys.stdout, "[rank 0] waiting")
    monkeypatch.setattr(sys, "stdout", watch)

    def release():
        if watch.seen.wait(60):
            go.touch()

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        assert waits_for_the_caller.distributed(str(go)) == [0, 1]
    finally:
        go.touch()
        releaser.join()
    assert "[rank 1]" not in watch.buffer


def test_two_launches_at_once_do_not_collide():
    @distributed(processes=2, output="none")
    def total(value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()

    results = {}

    def launch(value):
        results[value] = total.distributed(value)

    threads = [threading.Thread(target=launch, args=(v,)) for v in (1, 10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {1: [2.0, 2.0], 10: [20.0, 20.0]}


def test_user_init_and_destroy_of_the_group_still_work():
    @distributed(processes=2)
    def own_group():
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.destroy_process_group()
        return rank

    assert own_group.distributed() == [0, 1]


def test_exception_names_rank_type_message_and_traceback():
    @distributed(processes=2)
    def fails_on_rank_1(message):
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError(message)
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone
        return "unreachable"

    with pytest.raises(DistributedError) as info:
        fails_on_rank_1.distributed("bad learning rate")
    text = str(info.value)
    assert text.startswith("rank 1 failed: ValueError: bad learning rate")
    assert "Traceback from rank 1:" in text and "in fails_on_rank_1" in text
    assert "raise ValueError(message)" in text  # the source line, from the caller's file
    failure = info.value.failures[1]
    assert failure.exc_type == "ValueError" and failure.exitcode == 1
    assert isinstance(info.value, RuntimeError)


def test_a_group_that_cannot_form_is_retried_then_reported(monkeypatch, caplog):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nbtools-no-such-if")
    caplog.set_level(logging.INFO, logger="nbtools.launch")

    @distributed(processes=2)
    def never_runs():
        raise AssertionError("user code ran although the group never formed")

    with pytest.raises(DistributedError, match="nbtools-no-such-if") as info:
        never_runs.distributed()
    assert all(f.phase == "group" for f in info.value.failures.values())
    assert "user code ran" not in str(info.value)
    assert sum("did not form" in r.getMessage() for r in caplog.records) == 2


def test_killed_rank_restarts_the_group_and_counts_restarts():
    @distributed(processes=2, max_restarts=2)
    def dies_twice():
        import torch
        import torch.distributed as dist

        from nbtools.runtime import get_restart_count

        if dist.get_rank() == 1 and get_restart_count() < 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
        return get_restart_count()

    assert dies_twice.distributed() == [2, 2]


def test_killed_rank_without_restarts_left_is_a_failure():
    @distributed(processes=2, max_restarts=1)
    def always_dies():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(
        DistributedError, match="rank 1 failed .after 2 attempts.: .*SIGKILL"
    ) as info:
        always_dies.distributed()
    assert info.value.failures[1].exitcode == -signal.SIGKILL
    assert info.value.failures[1].attempt == 1


@pytest.mark.usefixtures("sigint_default")
def test_interrupt_stops_every_rank_and_the_next_call_works(tmp_path, monkeypatch):
    shm_before = set(os.listdir("/dev/shm"))

    @distributed(processes=2)
    def hangs(pid_dir):
        import time

        import torch
        import torch.distributed as dist

        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        print("ready", flush=True)
        if dist.get_rank() == 0:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))  # rank 1 waits in a collective

    watch = Watch(sys.stdout, "[rank 0] ready", "[rank 1] ready")
    monkeypatch.setattr(sys, "stdout", watch)

    def interrupt():
        if watch.seen.wait(60):
            os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            hangs.distributed(str(tmp_path))
    finally:
        interrupter.join()
    pids = [int(name) for name in os.listdir(tmp_path)]
    assert len(pids) == 2
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    # Other test processes may share /dev/shm; segments of the ranks carry their pid.
    new_shm = set(os.listdir("/dev/shm")) - shm_before
    assert not [e for e in new_shm if any(str(pid) in e for pid in pids)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    @distributed(processes=2)
    def fine():
        return "ok"

    assert fine.distributed() == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.skipif(_env.visible_gpu_count() == 0, reason="needs a CUDA GPU")
def test_gpu_ranks_use_their_device_and_nccl_with_cuda_initialised_here():
    import torch

    torch.ones(1, device="cuda")  # CUDA is initialised in the caller, as in a busy notebook
    count = min(2, torch.cuda.device_count())

    @distributed(gpus=count)
    def on_gpu():
        import torch
        import torch.distributed as dist

        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        return torch.cuda.current_device(), t.item(), str(dist.get_backend())

    results = on_gpu.distributed()
    assert [r[0] for r in results] == list(range(count))
    assert all(r[1] == count and "nccl" in r[2] for r in results)


DDP_ASYNC_SAVE = """
import os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from nbtools import distributed

ROOT = sys.argv[1]

@distributed(processes=2, output="none")
def train(steps):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    future = None
    for step in range(steps):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()               # DDP's all-reduce on the default (gloo) group
        optimizer.step()
        if future is not None:
            future.result()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # As the reference documents: on the default group, the save in the background.
        future = dcp.async_save({"model": model_sd, "optim": optim_sd, "step": step},
                                checkpoint_id=os.path.join(ROOT, f"step_{step}"))
    future.result()
    return step

print(train.distributed(6))
"""


@pytest.mark.slow
def test_ddp_with_async_saves_on_the_default_gloo_group_finishes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_ASYNC_SAVE)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("[5, 5]"), proc.stdout
    assert all((tmp_path / "ckpt" / f"step_{i}" / ".metadata").exists() for i in range(6))


def test_ranks_know_where_returned_cuda_tensors_arrive():
    @distributed(processes=2, output="none")
    def where():
        return os.environ["NBTOOLS_RESULTS_DEVICE"]

    @distributed(processes=2, output="none", results_device="cuda")
    def kept():
        return os.environ["NBTOOLS_RESULTS_DEVICE"]

    assert where.distributed() == ["cpu", "cpu"]
    assert kept.distributed() == ["cuda", "cuda"]
    with pytest.raises(ValueError, match="results_device must be one of 'cpu', 'cuda'"):
        distributed(processes=2, results_device="gpu")


CUDA_RESULTS = """
import torch
from nbtools import distributed

@distributed(gpus=1, output="none")
def make():
    layer = torch.nn.Linear(4, 2).cuda()
    return torch.ones(3, device="cuda", requires_grad=True), layer.weight, layer

t, weight, layer = make.distributed()[0]
assert t.device.type == "cpu" and t.requires_grad, t
assert weight.device.type == "cpu" and isinstance(weight, torch.nn.Parameter), weight
assert layer.weight.device.type == "cpu"
assert not torch.cuda.is_initialized(), "the caller created a CUDA context for the results"

@distributed(gpus=1, output="none", results_device="cuda")
def keep():
    return torch.ones(3, device="cuda")

assert keep.distributed()[0].device.type == "cuda"
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(_env.visible_gpu_count() == 0, reason="needs a CUDA GPU")
def test_cuda_tensors_a_rank_returns_arrive_in_host_memory_unless_asked(tmp_path):
    script = tmp_path / "cuda_results.py"
    script.write_text(CUDA_RESULTS)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
