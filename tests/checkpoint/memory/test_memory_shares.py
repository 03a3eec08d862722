"""The ranks of a node snapshot their replicated state once between them (``_shares``)."""

from __future__ import annotations

import pytest
import torch

from nbtools.checkpoint import _objects, _state
from nbtools.checkpoint._memory import _layout, _sharded
from nbtools.errors import CheckpointError


def _state_of(seed: int = 0, width: int = 64) -> dict:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3)
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(2, width)).sum().backward()
    opt.step()
    kinds = _objects.classify({"model": net, "optimizer": opt})
    return _state.build_state(5, kinds, 0, 3, {"note": "x"}, None)


def _through_a_slot(state: dict) -> tuple[dict, int]:
    """``state`` written as a snapshot body and read back; and its tensor region's size."""
    layout = _layout.plan(state)
    tail = _layout.skeleton_bytes(layout)
    body = bytearray(layout.data_len + len(tail))
    for dest, tensor in zip(_layout.destinations(body, layout), layout.tensors, strict=True):
        dest.copy_(tensor)
    body[layout.data_len :] = tail
    return _layout.decode(body, layout.data_len), layout.data_len


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_three_shares_hold_the_state_once_and_give_it_back_whole():
    state = _state_of()
    whole, full = _through_a_slot(state)
    shares = [_layout.Share(base=4, count=3, index=i) for i in range(3)]
    read = {4 + s.index: _through_a_slot(_layout.mark(state, s)) for s in shares}
    sizes = [n for _, n in read.values()]
    # Each slot holds about a third of the tensors; together, each tensor once.
    assert max(sizes) < 0.5 * full and abs(sum(sizes) - full) <= 3 * 64 * 20
    for rank, (mine, _) in read.items():
        assert _layout.owners(mine) == {4, 5, 6} - {rank}
        peers = {r: read[r][0] for r in read if r != rank}
        back = _layout.fill(mine, peers, f"rank {rank}'s snapshot")
        assert set(back) == set(whole)
        assert back[_state.NS] == whole[_state.NS]  # the per-rank part is each rank's own
        got, want = _tensors(back), _tensors(whole)
        assert len(got) == len(want)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))


def test_a_share_of_another_layout_or_a_missing_one_is_refused_naming_the_rank():
    state, other = _state_of(width=64), _state_of(width=32)
    mine, _ = _through_a_slot(_layout.mark(state, _layout.Share(0, 2, 0)))
    theirs, _ = _through_a_slot(_layout.mark(other, _layout.Share(0, 2, 1)))
    with pytest.raises(CheckpointError, match="rank 1 it shares tensors with hold different"):
        _layout.fill(mine, {1: theirs}, "rank 0's snapshot")
    with pytest.raises(CheckpointError, match="needs the snapshot of rank 1; none was read"):
        _layout.fill(mine, {}, "rank 0's snapshot")


def test_sharded_state_whose_replicated_tensors_are_all_tiny_is_not_shared():
    # A data-parallel model's weights are worth one copy per node, however small. An FSDP2
    # state's only replicated tensors are its optimizer's step counts: sharing those would
    # make every restore read every peer's slot for a few bytes each.
    state = _state_of()
    assert _layout.worth_sharing(state)
    tiny = {k: v for k, v in state.items() if k in ("step", _state.NS)}
    tiny["optimizer"] = {"state": {0: {"step": torch.tensor(3.0)}}}
    assert _layout.worth_sharing(tiny)  # no sharded tensor: plain state is shared
    tiny["model"] = {"weight": {_sharded.MARK: 0}}  # a DTensor's local shard, as flattened
    assert not _layout.worth_sharing(tiny)
    tiny["optimizer"]["state"][1] = {"exp_avg": torch.zeros(256)}  # 1 KiB, replicated
    assert _layout.worth_sharing(tiny)


def test_the_ranks_of_a_node_share_only_when_they_all_hold_the_same_tensors():
    node_a, node_b = "machine-a", "machine-b"
    reports = [(0, 2, "d", node_a), (0, 2, "d", node_a), (2, 2, "d", node_b), (2, 2, "e", node_b)]
    assert _layout.decide(0, reports) == _layout.Share(0, 2, 0)
    assert _layout.decide(1, reports) == _layout.Share(0, 2, 1)
    assert _layout.decide(2, reports) is None  # rank 3 holds other tensors: no sharing there
    assert _layout.decide(3, reports) is None
    alone = [(0, 1, "d", node_a), (1, 1, "d", node_b)]
    assert _layout.decide(0, alone) is None and _layout.decide(1, alone) is None
    # A node whose ranks are not where the count says (another machine) keeps whole copies.
    assert _layout.decide(0, [(0, 2, "d", node_a), (0, 2, "d", node_b)]) is None


@pytest.mark.slow
def test_four_ranks_snapshot_a_quarter_each_and_a_killed_run_resumes_bit_exact(tmp_path, shm):
    from nbtools import distributed

    @distributed(processes=4, max_restarts=1, output="none")
    def train(root):
        import glob
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        full = 3 * sum(p.numel() * p.element_size() for p in net.parameters())
        sizes = []
        with CheckpointManager(root, every=100, memory_every=2, async_save=False) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 12):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(4, 256)).pow(2).mean().backward()
                for p in net.parameters():  # MAX of equal gradients: the same bits everywhere
                    dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 10:
                    ckpt.wait()
                    mine = f"{os.environ['NBTOOLS_SNAPSHOT_DIR']}/*/*/r{dist.get_rank()}-*.slot"
                    sizes = [os.path.getsize(p) for p in glob.glob(mine)]
                if step == 9 and dist.get_rank() == 2 and get_restart_count() == 0:
                    ckpt.wait()  # step 8's snapshot is complete
                    os.kill(os.getpid(), signal.SIGKILL)
        tensors = list(net.state_dict().values())
        tensors += [t for s in opt.state.values() for t in s.values()]
        sums = [t.double().sum().item() for t in tensors]
        return get_restart_count(), ckpt.restored_step, ckpt.restored_tier, sums, sizes, full

    results = train.distributed(str(tmp_path / "root"))
    assert {r[:3] for r in results} == {(1, 8, "memory")}
    for *_, sizes, full in results:  # each slot holds about a quarter of the state
        assert sizes and all(0.15 * full < s < 0.4 * full for s in sizes)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(12):
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(4, 256)).pow(2).mean().backward()
        opt.step()
    tensors = list(net.state_dict().values())
    tensors += [t for s in opt.state.values() for t in s.values()]
    assert all(r[3] == [t.double().sum().item() for t in tensors] for r in results)
    assert not any(p.is_file() for p in shm.rglob("*"))  # closed cleanly: removed


@pytest.mark.slow
def test_a_damaged_share_sends_every_rank_back_to_the_step_before(tmp_path, shm, caplog):
    # Two ranks of one node share their tensors. Before rank 1 is killed it damages rank
    # 0's newest slot: step 6 cannot be put together, so both restore step 4, bit-exact.
    from nbtools import distributed

    @distributed(processes=2, max_restarts=1, output="none")
    def train(root):
        import glob
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Linear(64, 64)
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        with CheckpointManager(root, every=100, memory_every=2, async_save=False) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 10):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(2, 64)).sum().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 7 and get_restart_count() == 0:
                    ckpt.wait()  # step 6's snapshots are complete on both ranks
                    dist.barrier()
                    if dist.get_rank() == 1:
                        slots = glob.glob(f"{os.environ['NBTOOLS_SNAPSHOT_DIR']}/*/*/r0-*.slot")
                        with open(max(slots, key=os.path.getmtime), "r+b") as fh:
                            fh.seek(4096 + 8)
                            byte = fh.read(1)
                            fh.seek(4096 + 8)
                            fh.write(bytes([byte[0] ^ 0xFF]))
                        os.kill(os.getpid(), signal.SIGKILL)
        weights = [p.detach().clone() for p in net.parameters()]
        return get_restart_count(), ckpt.restored_step, ckpt.restored_tier, weights

    results = train.distributed(str(tmp_path / "root"))
    assert [r[:3] for r in results] == [(1, 4, "memory"), (1, 4, "memory")]
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    for step in range(10):
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(2, 64)).sum().backward()
        for p in net.parameters():
            p.grad.mul_(2)
        opt.step()
    for *_, weights in results:
        assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters(), strict=True))
    assert not any(p.is_file() for p in shm.rglob("*"))
