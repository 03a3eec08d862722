"""The memory tier under faults: damaged headers, repeated failures, untrusted directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from nbtools.checkpoint._memory import _slots

# A run defined in __main__ (as in a notebook cell) whose every step draws from the global
# RNG: a resume that lost a step or the RNG streams shows in the weights.
_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from nbtools.checkpoint import CheckpointManager

    root, kill_at, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    ckpt = CheckpointManager(root, every=20, memory_every=4)
    start = ckpt.restore(model=net, optimizer=opt)
    for step in range(start, steps):
        opt.zero_grad()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        ckpt.maybe_save(step, model=net, optimizer=opt)
        if step == kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    print(json.dumps({"start": start, "tier": ckpt.restored_tier,
                      "weights": [p.double().sum().item() for p in net.parameters()]}))
    """
)


def _run(tmp_path, root, kill_at, steps=24):
    script = tmp_path / "train.py"
    script.write_text(_RUN)
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(kill_at), str(steps)],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCHELASTIC_RUN_ID": "faults"},
        timeout=300,
    )
    if kill_at >= 0:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        return None, proc.stderr
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _header(path) -> tuple[bytes, dict]:
    data = path.read_bytes()
    head = data[: _slots.HEADER_BYTES]
    return data, json.loads(head[len(b"NBTSNAP3") :].decode())


@pytest.mark.slow
@pytest.mark.parametrize("resealed", [False, True], ids=["flipped", "flipped-and-resealed"])
def test_a_slot_whose_header_claims_another_step_is_never_restored(tmp_path, shm, resealed):
    reference, _ = _run(tmp_path, tmp_path / "ref", -1)
    _run(tmp_path, tmp_path / "root", kill_at=13)  # after the step-12 snapshot
    slots = {_header(p)[1]["step"]: p for p in shm.rglob("*.slot")}
    assert sorted(slots) == [8, 12]
    data, head = _header(slots[12])
    if resealed:  # a header that agrees with its own checksum: the snapshot's step tells
        block = _slots._sealed({k: v for k, v in head.items() if k != "head_crc"} | {"step": 10})
    else:  # the flipped bits of the issue: "step": 12 read as "step": 10
        block = data[: _slots.HEADER_BYTES].replace(b'"step": 12', b'"step": 10')
    slots[12].write_bytes(block + data[_slots.HEADER_BYTES :])
    resumed, stderr = _run(tmp_path, tmp_path / "root", -1)
    # Step 12's slot is skipped, with one warning; step 8 (the next candidate) is restored.
    assert (resumed["start"], resumed["tier"]) == (9, "memory")
    assert resumed["weights"] == reference["weights"]
    why = "holds step 12 where its header says 10" if resealed else "does not match its checksum"
    assert stderr.count(why) == 1, stderr


def _two_ranks(root, log, second_kill):
    from nbtools import distributed

    @distributed(processes=2, max_restarts=2, output="none")
    def train(root, log, second_kill):
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        restart, rank = get_restart_count(), dist.get_rank()
        with CheckpointManager(root, every=100, memory_every=4, async_save=False) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            if rank == 0:
                with open(log, "a") as fh:
                    fh.write(f"{restart} {ckpt.restored_step} {ckpt.restored_tier}\n")
            for step in range(start, 20):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(2, 4)).sum().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if rank == 1 and restart == 0 and step == 12:
                    ckpt.wait()  # right after the step-12 snapshot
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == 1 and restart == 1 and step == second_kill:
                    if step % 4:
                        ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)  # at 16: during its snapshot
        return [p.double().sum().item() for p in net.parameters()]

    return train.distributed(root, log, second_kill)


def _reference():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    for step in range(20):
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(2, 4)).sum().backward()
        for p in net.parameters():
            p.grad.mul_(2)
        opt.step()
    return [p.double().sum().item() for p in net.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("second_kill", [14, 16], ids=["before-the-next-snapshot", "during-it"])
def test_a_second_failure_after_a_recovery_goes_back_at_most_memory_every(
    tmp_path, shm, second_kill
):
    log = tmp_path / "restores.txt"
    weights = _two_ranks(str(tmp_path / "root"), str(log), second_kill)
    restores = [line.split() for line in log.read_text().splitlines()]
    assert restores[:2] == [["0", "None", "None"], ["1", "12", "memory"]]
    # The restored step stays restorable until a newer snapshot is published: step 12 (or
    # 16, when the killed rank's snapshot of it was published), never step 8.
    assert restores[2][0] == "2" and int(restores[2][1]) >= 12 and restores[2][2] == "memory"
    assert weights[0] == weights[1] == _reference()
    assert not any(p.is_file() for p in shm.rglob("*"))
