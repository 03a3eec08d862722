"""Replicas of the memory tier: a rank's snapshot held by a peer, restored from when its own
is lost; the raw snapshot format; progress reports of a loop that only saves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from ckpt_training import two_rank_reference

from nbtools import events
from nbtools.checkpoint import CheckpointManager
from nbtools.checkpoint._memory import _layout, _replicas


def test_holders_are_on_other_nodes_and_the_next_ranks_on_one_node():
    # 3 nodes of 2 ranks: rank 1 (node 0) is held by rank 3 (node 1), then rank 5 (node 2).
    assert _replicas.holders(1, 6, 2, 1) == [3]
    assert _replicas.holders(1, 6, 2, 2) == [3, 5]
    assert _replicas.holders(5, 6, 2, 1) == [1]
    assert _replicas.sources(3, 6, 2, 1) == [1]
    assert _replicas.holders(1, 6, 2, 5) == [3, 5]  # never more than the other nodes
    # One node: the next ranks.
    assert _replicas.holders(2, 3, 3, 1) == [0]
    assert _replicas.sources(0, 3, 3, 1) == [2]
    assert _replicas.holders(0, 1, 1, 1) == []
    for world, local, k in ((6, 2, 2), (4, 4, 2), (8, 4, 1)):
        for rank in range(world):
            for holder in _replicas.holders(rank, world, local, k):
                assert rank in _replicas.sources(holder, world, local, k)
                assert holder != rank


@pytest.mark.parametrize(
    "bad, error", [(-1, ValueError), ("1", TypeError), (1.0, TypeError), (True, TypeError)]
)
def test_replicas_must_be_an_int_of_at_least_zero(tmp_path, bad, error):
    with pytest.raises(error, match="replicas"):
        CheckpointManager(tmp_path / "root", memory_every=5, replicas=bad)


def test_a_snapshot_body_gives_back_every_tensor_bit_for_bit():
    torch.manual_seed(0)
    wide = torch.randn(6, 8)
    state = {
        "step": 3,
        "model": {
            "w": torch.randn(5, 7),
            "half": torch.randn(3).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "strided": wide[:, ::2],  # not contiguous
        },
        "opt": {"param_groups": [{"betas": (0.9, 0.999), "params": ["w"]}], "state": {}},
        "nbtools": {"rank_0": b"\x00blob"},
    }
    layout = _layout.plan(state)
    assert all(offset % _layout.ALIGN == 0 for _, _, offset in layout.table)
    body = bytearray(layout.data_len)
    for dest, tensor in zip(_layout.destinations(body, layout), layout.tensors, strict=True):
        dest.copy_(tensor)
    body += _layout.skeleton_bytes(layout)
    back = _layout.decode(body, layout.data_len)
    assert back["step"] == 3 and back["nbtools"] == {"rank_0": b"\x00blob"}
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.999)
    for name, value in state["model"].items():
        got = back["model"][name]
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert torch.equal(got, value), name


def _reference():
    return [p.detach() for p in two_rank_reference(torch.optim.Adam, 10).parameters()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, expected",
    [
        ("own", [(1, 6, "memory"), (1, 6, "replica")]),  # rank 1's step 6 from rank 0's replica
        ("node", [(1, 6, "memory"), (1, 6, "replica")]),  # its whole node's memory lost
        ("both", [(1, 5, "volume"), (1, 5, "volume")]),  # no source of step 6 left for rank 1
    ],
)
def test_a_rank_whose_snapshot_is_lost_restores_from_its_replica_else_the_volume(
    tmp_path, shm, damage, expected
):
    # A run of 2 ranks that keeps one replica of each rank's snapshot on the other, each rank
    # with a snapshot directory of its own (a node's memory). Rank 1 is killed at step 7; before
    # that it damages its own newest slot ("own"), and removes its directory ("node") or the
    # replica rank 0 holds of it ("both").
    def _train(root, damage):
        import glob
        import os
        import shutil
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        rank = dist.get_rank()
        # Each rank's snapshots in a directory of its own: two nodes' memories, on one machine.
        base = os.environ["NBTOOLS_SNAPSHOT_DIR"]
        os.environ["NBTOOLS_SNAPSHOT_DIR"] = node = os.path.join(base, f"node{rank}")
        os.makedirs(node, exist_ok=True)
        with CheckpointManager(root, every=5, memory_every=2, replicas=1) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 10):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(2, 4)).sum().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 7 and get_restart_count() == 0:
                    ckpt.wait()  # step 6's snapshots and replicas are complete on both ranks
                    dist.barrier()
                    if rank == 1:
                        own = sorted(glob.glob(f"{node}/*/*/r1-*.slot"), key=os.path.getmtime)
                        with open(own[-1], "r+b") as fh:
                            fh.seek(-64, os.SEEK_END)
                            byte = fh.read(1)
                            fh.seek(-64, os.SEEK_END)
                            fh.write(bytes([byte[0] ^ 0xFF]))
                        if damage == "node":  # the node's memory is gone with it
                            shutil.rmtree(node)
                        if damage == "both":
                            for path in glob.glob(f"{base}/node0/*/*/x1-h0-*.slot"):
                                os.unlink(path)
                        os.kill(os.getpid(), signal.SIGKILL)
        weights = [p.detach().clone() for p in net.parameters()]
        return get_restart_count(), ckpt.restored_step, ckpt.restored_tier, weights

    from nbtools import distributed

    job = distributed(processes=2, max_restarts=1, output="none")(_train)
    results = job.distributed(str(tmp_path / "root"), damage)
    assert [r[:3] for r in results] == expected
    restored = [e for e in events.log(kinds=["checkpoint_restored"]) if e.rank == 0]
    assert restored[-1].fields["tier"] == ("volume" if damage == "both" else "replica")
    reference = _reference()
    for _, _, _, weights in results:  # bit-exact with an uninterrupted run
        assert all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))
    assert not any(p.is_file() for p in shm.rglob("*"))  # closed cleanly: all removed


@pytest.mark.slow
def test_a_loop_that_only_saves_through_the_manager_reports_progress(tmp_path):
    bus = events.Bus()
    code = f"""
        import time
        import torch
        from nbtools.checkpoint import CheckpointManager
        net = torch.nn.Linear(2, 2)
        with CheckpointManager({str(tmp_path / "root")!r}, every=None, save_on_close=False) as ckpt:
            for step in range(30):
                time.sleep(0.05)
                ckpt.maybe_save(step, model=net)
        time.sleep(1.5)   # the flusher ships the latest count about once a second
    """
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="1")
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], env=env, check=True, timeout=120
        )
        collector.drain()
    reports = [e for e in bus.log() if e.kind == "progress"]
    assert reports and all(e.rank == 1 for e in reports)
    assert reports[-1].step == 29 and reports[-1].fields["steps"] == 30
