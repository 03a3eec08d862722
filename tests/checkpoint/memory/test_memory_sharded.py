"""Sharded state (FSDP2's ``fully_shard``, tensor parallelism) recovered from memory."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import pytest
import torch

from nbtools import distributed, events
from nbtools.checkpoint import CheckpointManager


def _job(processes: int):
    """A launch of ``processes`` ranks training a model sharded as a user would shard it:
    FSDP2 over every rank, or (``tp``) FSDP2 over a 2 x 2 mesh's ``dp`` dimension and
    tensor parallelism over its ``tp`` dimension. Snapshots every 2 steps; the volume's only
    checkpoint before step 100 is step 0's, which a restore from memory never reads.
    Rank 1 is SIGKILLed once after step ``kill_at`` (when >= 0), once every rank's newest
    snapshot is complete; with ``lose``, it first removes its own snapshots: its slot comes
    back from the replica rank 0 holds. With ``meta``, the restarted ranks build their
    model on the meta device; with ``reshard``, they shard it over a 2-D mesh."""

    def train(root, kill_at, tp, lose, meta, reshard=False):
        import logging
        import os
        import shutil
        import signal

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        class Block(torch.nn.Module):
            def __init__(self, width):
                super().__init__()
                self.up = torch.nn.Linear(width, 4 * width)
                self.down = torch.nn.Linear(4 * width, width)

            def forward(self, x):
                return x + self.down(torch.relu(self.up(x)))

        class Net(torch.nn.Module):
            def __init__(self, width=16):
                super().__init__()
                self.blocks = torch.nn.ModuleList(Block(width) for _ in range(2))
                self.head = torch.nn.Linear(width, 3)

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return self.head(x)

        rank, world = dist.get_rank(), dist.get_world_size()
        if reshard and get_restart_count():  # restarted ranks shard the model otherwise
            tp = True
        if lose:  # each rank's snapshots in a directory of its own: two nodes' memories
            base = os.environ["NBTOOLS_SNAPSHOT_DIR"]
            os.environ["NBTOOLS_SNAPSHOT_DIR"] = node = os.path.join(base, f"node{rank}")
            os.makedirs(node, exist_ok=True)
        if tp:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            dp_mesh, dp_rank = mesh["dp"], mesh.get_coordinate()[0]
        else:
            dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            dp_rank = rank
        torch.manual_seed(0)
        # With ``meta``, a restarted rank builds its model on the meta device.
        with torch.device("meta" if meta and get_restart_count() else "cpu"):
            net = Net()
        if tp:
            for block in net.blocks:
                parallelize_module(
                    block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
                )
        for block in net.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(net, mesh=dp_mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        said = []

        class Said(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())

        logging.getLogger("nbtools").addHandler(Said(logging.WARNING))
        with CheckpointManager(
            root, every=100, memory_every=2, replicas=1 if lose else 0, async_save=False
        ) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt, init=lambda m: None)
            for step in range(start, 12):
                torch.manual_seed(1000 * step + dp_rank)  # each data-parallel rank its batch
                opt.zero_grad()
                net(torch.randn(4, 16)).pow(2).mean().backward()
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == kill_at and get_restart_count() == 0:
                    ckpt.wait()  # the snapshot of the step before is complete on every rank
                    dist.barrier()
                    if rank == 1:
                        if lose:
                            shutil.rmtree(node)
                        os.kill(os.getpid(), signal.SIGKILL)
        params = [p.to_local().detach().clone() for p in net.parameters()]
        state = [
            (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
            for s in opt.state.values()
            for t in s.values()
        ]
        with open("/proc/self/maps") as fh:  # nothing left mapped of a restored slot
            slots = [line.split()[-1] for line in fh if line.rstrip().endswith(".slot")]
        return (
            get_restart_count(),
            ckpt.restored_step,
            ckpt.restored_tier,
            params,
            state,
            slots,
            said,
        )

    return distributed(processes=processes, max_restarts=1, output="none")(train)


def _same(results, reference):
    for got, want in zip(results, reference, strict=True):
        for a, b in zip(got[3] + got[4], want[3] + want[4], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow
def test_fsdp2_killed_at_a_random_step_resumes_from_memory_bit_identical(tmp_path, shm):
    kill_at = random.Random().choice([3, 4, 5, 6, 7, 8, 9])
    job = _job(2)
    reference = job.distributed(str(tmp_path / "reference"), -1, False, False, False)
    results = job.distributed(str(tmp_path / "root"), kill_at, False, False, False)
    snapshot = kill_at - kill_at % 2  # the newest snapshot complete at the kill
    assert [r[:3] for r in results] == [(1, snapshot, "memory")] * 2, kill_at
    assert not any("cannot be snapshotted" in line for r in results for line in r[6])
    assert all(r[5] == [] for r in results)  # no slot page left mapped
    _same(results, reference)
    restored = [e for e in events.log(kinds=["checkpoint_restored"]) if e.rank == 0]
    assert restored[-1].fields["tier"] == "memory"
    assert not any(p.is_file() for p in shm.rglob("*"))  # closed cleanly: removed


@pytest.mark.slow
def test_a_lost_fsdp2_slot_comes_back_from_its_replica(tmp_path, shm):
    job = _job(2)
    reference = job.distributed(str(tmp_path / "reference"), -1, False, False, False)
    results = job.distributed(str(tmp_path / "root"), 7, False, True, False)
    assert [r[:3] for r in results] == [(1, 6, "memory"), (1, 6, "replica")]
    _same(results, reference)
    assert not any(p.is_file() for p in shm.rglob("*"))


@pytest.mark.slow
def test_an_fsdp2_model_built_on_the_meta_device_restores_from_memory(tmp_path, shm):
    job = _job(2)
    reference = job.distributed(str(tmp_path / "reference"), -1, False, False, False)
    results = job.distributed(str(tmp_path / "root"), 5, False, False, True)
    assert [r[:3] for r in results] == [(1, 4, "memory")] * 2
    _same(results, reference)


@pytest.mark.slow
def test_fsdp2_with_tensor_parallelism_on_a_2d_mesh_resumes_from_memory(tmp_path, shm):
    job = _job(4)
    reference = job.distributed(str(tmp_path / "reference"), -1, True, False, False)
    results = job.distributed(str(tmp_path / "root"), 5, True, False, False)
    assert [r[:3] for r in results] == [(1, 4, "memory")] * 4
    _same(results, reference)
    assert not any(p.is_file() for p in shm.rglob("*"))


@pytest.mark.slow
def test_fsdp2_restarted_on_another_mesh_uses_the_volume_and_says_why(tmp_path, shm):
    job = _job(2)
    results = job.distributed(str(tmp_path / "root"), 7, False, False, False, True)
    assert [r[:3] for r in results] == [(1, 0, "volume")] * 2  # DCP resharded step 0
    said = [line for line in results[0][6] if "not restoring step 6 from memory" in line]
    assert len(said) == 1, results[0][6]
    assert "sharded over mesh [0, 1] (dp) with placements [Shard(dim=0)]" in said[0]
    assert "another mesh, so the volume is used, where DCP reshards" in said[0]


def test_a_run_at_another_world_size_uses_the_volume_and_says_why(
    tmp_path, shm, monkeypatch, caplog
):
    # The same job's snapshots, taken by 2 ranks (an elastic job that then shrank to 1).
    monkeypatch.setenv("WORLD_SIZE", "2")
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=100, memory_every=2, async_save=False) as ckpt,
    ):
        for step in range(1, 4):  # a snapshot at step 2, nothing on the volume
            opt.zero_grad()
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
            ckpt.maybe_save(step, model=net, optimizer=opt)
        raise RuntimeError("killed")
    assert list(shm.rglob("*.slot"))
    monkeypatch.delenv("WORLD_SIZE")
    caplog.set_level(logging.WARNING, logger="nbtools")
    with CheckpointManager(tmp_path / "root", memory_every=2, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 0  # the volume holds nothing
    lines = [
        r.getMessage() for r in caplog.records if "memory snapshots were taken" in r.getMessage()
    ]
    assert lines == [
        "restoring from the volume: this run's memory snapshots were taken by 2 rank(s) and "
        "it has 1 now; a checkpoint on the volume is resharded by DCP"
    ]


_CELLS = [
    """\
import json, os, signal
import torch
from nbtools import distributed, runtime
from nbtools.checkpoint import CheckpointManager


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
""",
    """\
@distributed(processes=2, max_restarts=1, output="rank0")
def train(root, kill_at):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ckpt = CheckpointManager(root, every=100, memory_every=2)
    start = ckpt.restore(model=net, optimizer=opt)
    print(f"starting at step {start}, restored from {ckpt.restored_tier}")
    for step in range(start, 12):
        torch.manual_seed(1000 * step + runtime.get_rank())
        opt.zero_grad()
        net(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        ckpt.maybe_save(step, model=net, optimizer=opt)
        if step == kill_at and runtime.get_restart_count() == 0:
            ckpt.wait()
            torch.distributed.barrier()
            if runtime.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    weights = [p.to_local().tolist() for p in net.parameters()]
    return {"restart": runtime.get_restart_count(), "tier": ckpt.restored_tier, "weights": weights}
""",
]


@pytest.mark.slow
@pytest.mark.kernel
def test_fsdp2_defined_in_notebook_cells_resumes_from_memory_in_a_kernel(tmp_path):
    helpers = str(Path(__file__).resolve().parents[2] / "integration")
    if helpers not in sys.path:
        sys.path.append(helpers)
    from _user_code_nb import NotebookKernel

    kill_at = random.Random().choice([3, 4, 5, 6, 7])
    with NotebookKernel(tmp_path) as nb:
        for cell in _CELLS:
            nb.run(cell)
        nb.run(f"reference = train.distributed({str(tmp_path / 'reference')!r}, -1)")
        output = nb.run(f"recovered = train.distributed({str(tmp_path / 'root')!r}, {kill_at})")
        reference = json.loads(str(nb.eval("json.dumps(reference)")))
        recovered = json.loads(str(nb.eval("json.dumps(recovered)")))
    start = kill_at - kill_at % 2 + 1
    assert f"starting at step {start}, restored from memory" in output, output
    assert [(r["restart"], r["tier"]) for r in recovered] == [(1, "memory")] * 2
    assert [r["weights"] for r in recovered] == [r["weights"] for r in reference]
