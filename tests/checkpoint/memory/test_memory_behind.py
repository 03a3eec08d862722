"""Snapshots whose parameters and optimizer state are copied behind training: the next
optimizer step waits for the copy, and a tensor changed in place before it drops only
that snapshot."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

from nbtools.checkpoint import CheckpointManager

_WIDTH = 1024  # 4 MiB per weight: a copy that takes longer than the next line of Python


class _Net(torch.nn.Module):
    """Weights an optimizer steps, and a batch norm whose running statistics a forward
    pass changes (copied at once, not behind)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.Linear(_WIDTH, _WIDTH)
        )
        self.norm = torch.nn.BatchNorm1d(_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers(x))


def _state(net: _Net, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.clone() for t in net.state_dict().values()]
    return tensors + [t.clone() for s in opt.state.values() for t in s.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _restore(root) -> tuple[int, str | None, list[torch.Tensor]]:
    """Restore into a fresh model; the manager closes on an error, so the snapshots stay."""
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with (
        pytest.raises(RuntimeError, match="keep"),
        CheckpointManager(root, memory_every=1, async_save=False, save_on_close=False) as ckpt,
    ):
        start = ckpt.restore(model=net, optimizer=opt)
        raise RuntimeError("keep")
    return start, ckpt.restored_tier, _state(net, opt)


def _drop_newest(shm) -> None:
    """Remove rank 0's newest slot (by the step its header names)."""
    steps = {}
    for path in shm.rglob("r0-*.slot"):
        with open(path, "rb") as fh:
            steps[path] = json.loads(fh.read(4096)[8:].decode())["step"]
    max(steps, key=lambda p: steps[p]).unlink()


def test_each_snapshot_holds_its_step_though_training_runs_on_during_its_copy(tmp_path, shm):
    hooks = set(_global_optimizer_pre_hooks)
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    kept = {}
    with (
        pytest.raises(RuntimeError, match="stop"),
        CheckpointManager(tmp_path / "root", every=1000, memory_every=1, async_save=False) as ckpt,
    ):
        for step in range(1, 6):
            # The forward pass changes the running statistics and the step the weights
            # while the previous snapshot may still be copying.
            loss = net(torch.randn(8, _WIDTH)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.maybe_save(step, model=net, optimizer=opt)
            kept[step] = _state(net, opt)
        assert len(set(_global_optimizer_pre_hooks) - hooks) == 1  # steps wait for the copy
        raise RuntimeError("stop")  # keeps the snapshots
    start, tier, restored = _restore(tmp_path / "root")
    assert (start, tier) == (6, "memory")
    assert _same(restored, kept[5])
    # The snapshot before it is whole too (the other slot).
    _drop_newest(shm)
    start, tier, restored = _restore(tmp_path / "root")
    assert (start, tier) == (5, "memory")
    assert _same(restored, kept[4])
    assert set(_global_optimizer_pre_hooks) == hooks  # the hook went with the close


def test_a_weight_changed_in_place_before_the_next_step_drops_only_that_snapshot(
    tmp_path, shm, caplog
):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    kept = {}
    with (
        caplog.at_level(logging.WARNING, logger="nbtools"),
        pytest.raises(RuntimeError, match="stop"),
        CheckpointManager(tmp_path / "root", every=1000, memory_every=1, async_save=False) as ckpt,
    ):
        for step in range(1, 5):
            net(torch.randn(8, _WIDTH)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.maybe_save(step, model=net, optimizer=opt)
            kept[step] = _state(net, opt)
            if step == 3:
                with torch.no_grad():  # not in an optimizer step: nothing waits for the copy
                    net.layers[0].weight.mul_(0.5)
                kept[3.5] = _state(net, opt)
        ckpt.wait()
        raise RuntimeError("stop")
    dropped = [r for r in caplog.records if "changed in place" in r.getMessage()]
    start, tier, restored = _restore(tmp_path / "root")
    assert (start, tier) == (5, "memory")
    assert _same(restored, kept[4])  # later snapshots copy at once, and hold their step
    # Step 3's snapshot holds step 3's state when its copy ended first; otherwise it was
    # dropped, with one warning, and the slot before it is step 2's. Never a torn state.
    _drop_newest(shm)
    start, tier, restored = _restore(tmp_path / "root")
    if dropped:
        assert len(dropped) == 1
        assert "step 3" in dropped[0].getMessage()
        assert (start, _same(restored, kept[2])) == (3, True)
    else:
        assert (start, _same(restored, kept[3])) == (4, True)
    assert not _same(kept[3], kept[3.5])


def test_the_file_of_the_second_snapshot_is_made_ahead_and_then_used(tmp_path, shm):
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step_and_snapshot(ckpt, step):
        net(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        assert ckpt.maybe_save(step, model=net, optimizer=opt) is False  # no volume save
        ckpt.wait()
        files = [p for p in shm.rglob("*") if p.is_file() and p.name.startswith((".tmp-", "r0-"))]
        return sorted(files, key=lambda p: p.name.startswith(".tmp-"))

    with CheckpointManager(tmp_path / "root", every=1000, memory_every=1, async_save=False) as ckpt:
        slot, spare = step_and_snapshot(ckpt, 1)  # one slot, and the next one's file
        assert slot.name.endswith(".slot") and spare.name.startswith(".tmp-r0-")
        info = spare.stat()  # private, its space reserved (not a sparse file)
        assert info.st_mode & 0o777 == 0o600 and info.st_blocks * 512 >= info.st_size > 4096
        made_ahead = spare.stat().st_ino
        second = step_and_snapshot(ckpt, 2)  # two slots, the second in that file
        assert [p.name.endswith(".slot") for p in second] == [True, True]
        assert made_ahead in {p.stat().st_ino for p in second}
        assert len(step_and_snapshot(ckpt, 3)) == 2  # from here on the older slot's file
    assert [p for p in shm.rglob("*") if p.is_file()] == []


def _adam_steps(steps: range, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in steps:
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(4, 512)).pow(2).mean().backward()
        opt.step()


def _sums(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    tensors = list(net.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]
    return [t.double().sum().item() for t in tensors]


@pytest.mark.slow
def test_eight_ranks_killed_mid_run_resume_bit_exact_from_snapshots_copied_behind(tmp_path, shm):
    # Eight ranks snapshot every step while the next step runs; rank 5 is killed with a
    # snapshot copy behind it in flight. Every rank resumes from the newest complete step.
    from nbtools import distributed

    @distributed(processes=8, max_restarts=1, output="none")
    def train(root):
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        with CheckpointManager(root, every=100, memory_every=1, async_save=False) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 12):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(4, 512)).pow(2).mean().backward()
                for p in net.parameters():  # MAX of equal gradients: the same bits everywhere
                    dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 7 and dist.get_rank() == 5 and get_restart_count() == 0:
                    os.kill(os.getpid(), signal.SIGKILL)  # step 7's copy may be in flight
        tensors = list(net.state_dict().values())
        tensors += [t for s in opt.state.values() for t in s.values()]
        sums = [t.double().sum().item() for t in tensors]
        return get_restart_count(), ckpt.restored_step, ckpt.restored_tier, sums

    results = train.distributed(str(tmp_path / "root"))
    assert {r[:3] for r in results} in ({(1, 6, "memory")}, {(1, 7, "memory")})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    _adam_steps(range(12), net, opt)
    assert all(r[3] == _sums(net, opt) for r in results)
    assert not any(p.is_file() for p in shm.rglob("*"))  # closed cleanly: removed
