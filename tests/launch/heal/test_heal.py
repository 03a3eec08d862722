"""Healing in place: ranks that survive a dead peer keep their processes, the replacement
heals from them, and the run ends as an uninterrupted one would.

Four CPU ranks (gloo) train a data-parallel model built on the meta device: the
gradients are all-reduced, each step's batch is a function of the step and the
rank, and each step also draws from the rank's global RNG (so a lost RNG stream
shows in the weights). A rank SIGKILLs itself before it joins a step's
all-reduce. Every completed step is logged per rank, with the rank's pid and
the attempt, in a directory of the test's own.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from nbtools import distributed, events
from nbtools.errors import DistributedError

pytestmark = [pytest.mark.slow]

_STEPS = 24


def _train(root: str, log: str, kills: dict, steps: int, raise_at: int | None = None) -> list:
    """One rank: restore, train to ``steps``, log each completed step; the final weights."""
    import signal

    import torch
    import torch.distributed as dist

    from nbtools.checkpoint import CheckpointManager
    from nbtools.runtime import get_restart_count

    rank, world, attempt = dist.get_rank(), dist.get_world_size(), get_restart_count()
    torch.manual_seed(0)  # the same initial weights on every rank (data parallelism)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager(root, memory_every=4, save_on_close=False) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt)
        if start == 0:
            torch.manual_seed(100 + rank)  # each rank's own stream (a restore puts it back)
        with open(os.path.join(log, f"start-{attempt}-{rank}.json"), "w") as fh:
            json.dump({"pid": os.getpid(), "start": start, "tier": ckpt.restored_tier}, fh)
        for step in range(start, steps):
            if rank in kills.get(str(attempt), {}).get(str(step), []):
                os.kill(os.getpid(), signal.SIGKILL)  # before this step's all-reduce
            if raise_at == step and rank == 1:
                raise ValueError("a bad batch")
            gen = torch.Generator().manual_seed(step * world + rank)  # the data position
            x = torch.randn(8, 16, generator=gen)
            noise = torch.rand(()) * 1e-3  # the rank's RNG stream
            loss = model(x).pow(2).mean() * (1 + noise)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            ckpt.maybe_save(step, model=model, optimizer=opt)
            with open(os.path.join(log, f"steps-{rank}.log"), "a") as fh:
                fh.write(f"{step} {os.getpid()} {attempt}\n")
    return [p.detach().clone() for p in model.parameters()]


def _launch(tmp_path, name: str, kills: dict, max_restarts: int, heal: bool, **kwargs) -> list:
    log = tmp_path / f"log-{name}"
    log.mkdir()
    job = distributed(processes=4, max_restarts=max_restarts, heal=heal, output="none")(_train)
    return job.distributed(str(tmp_path / name), str(log), kills, _STEPS, **kwargs)


def _steps(tmp_path, name: str, rank: int) -> list[tuple[int, int, int]]:
    with open(tmp_path / f"log-{name}" / f"steps-{rank}.log") as fh:
        return [tuple(int(v) for v in line.split()) for line in fh]  # type: ignore[misc]


def _same(a: list, b: list) -> bool:
    return all(
        torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
    )


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A snapshot base of the test's own for the memory tier (``NBTOOLS_SNAPSHOT_DIR``)."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(path))
    return path


@pytest.fixture
def reference(tmp_path, shm):
    """The weights of the same run with no kill."""
    return _launch(tmp_path, "reference", {}, 0, heal=False)


def test_a_rank_killed_three_times_heals_in_place_and_ends_as_the_uninterrupted_run(
    tmp_path, shm, reference
):
    rng = random.Random(51)
    picks = sorted(rng.sample(range(3, _STEPS - 2), 3))
    kills = {str(a): {str(step): [rng.randrange(4)]} for a, step in enumerate(picks)}
    since = time.time()
    got = _launch(tmp_path, "healed", kills, 3, heal=True)
    assert _same(got, reference)
    log = tmp_path / "log-healed"
    for attempt in range(3):
        (killed,) = kills[str(attempt)].values()
        for rank in range(4):
            with open(log / f"start-{attempt}-{rank}.json") as fh:
                before = json.load(fh)
            with open(log / f"start-{attempt + 1}-{rank}.json") as fh:
                after = json.load(fh)
            # The survivors keep their processes; the dead rank's replacement is new.
            assert (before["pid"] == after["pid"]) == (rank not in killed), (attempt, rank)
            # Every rank took the state the survivors held: nothing from the snapshots.
            assert after["tier"] == "live", (attempt, rank, after)
    for rank in range(4):
        # Each step trained exactly once on every rank: no sample seen twice.
        assert [s for s, _, _ in _steps(tmp_path, "healed", rank)] == list(range(_STEPS))
    healed = events.log(since=since, kinds=["healed"])
    assert len(healed) == 3
    assert all(e.fields["trained_again"] == 0 for e in healed), healed
    assert "kept their processes" in (healed[0].message or ""), healed[0]


def test_a_rank_that_raises_fails_the_call_and_nothing_heals(tmp_path, shm):
    since = time.time()
    with pytest.raises(DistributedError) as info:
        _launch(tmp_path, "raises", {}, 1, heal=True, raise_at=3)
    assert info.value.failures[1].exc_type == "ValueError"
    assert not events.log(since=since, kinds=["healed"])
    # The call restarted the group as without healing: rank 1 raised again each time.
    assert len(events.log(since=since, kinds=["restart"])) == 1


def test_two_ranks_killed_at_once_end_as_the_uninterrupted_run(tmp_path, shm, reference):
    got = _launch(tmp_path, "two", {"0": {"9": [1, 2]}}, 2, heal=True)
    assert _same(got, reference)
    for rank in range(4):
        steps = [s for s, _, _ in _steps(tmp_path, "two", rank)]
        assert sorted(set(steps)) == list(range(_STEPS))


def test_every_rank_killed_at_once_restarts_the_group_and_ends_as_the_uninterrupted_run(
    tmp_path, shm, reference
):
    # No process is left to heal around: the group restarts whole, from memory, as without
    # healing, and says why in the log rather than failing in the heal.
    since = time.time()
    got = _launch(tmp_path, "all", {"0": {"9": [0, 1, 2, 3]}}, 2, heal=True)
    assert _same(got, reference)
    assert len(events.log(since=since, kinds=["restart"])) >= 1
    for rank in range(4):
        steps = [s for s, _, _ in _steps(tmp_path, "all", rank)]
        assert sorted(set(steps)) == list(range(_STEPS))


def test_a_replacement_killed_before_its_first_step_heals_again(tmp_path, shm, reference):
    # Attempt 1's rank 2 (the replacement) dies before the healed group trains a step.
    got = _launch(tmp_path, "again", {"0": {"9": [2]}, "1": {"9": [2]}}, 3, heal=True)
    assert _same(got, reference)
    for rank in range(4):
        # The restored objects are live again: the second heal takes them too.
        with open(tmp_path / "log-again" / f"start-2-{rank}.json") as fh:
            assert json.load(fh)["tier"] == "live", rank
    for rank in range(4):
        steps = [s for s, _, _ in _steps(tmp_path, "again", rank)]
        assert sorted(set(steps)) == list(range(_STEPS))


CELL_DEFINED = """
import os, signal, sys
import torch
import torch.distributed as dist
from nbtools import distributed
from nbtools.checkpoint import CheckpointManager
from nbtools.runtime import get_restart_count

class Net(torch.nn.Module):           # defined where a notebook defines it: in __main__
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(x)

def train(root, kill):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(root, memory_every=2, save_on_close=False) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start, 10):
            if kill and get_restart_count() == 0 and step == 5 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            gen = torch.Generator().manual_seed(step * world + rank)
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            ckpt.maybe_save(step, model=model, optimizer=opt)
        return ckpt.restored_tier, [p.detach().clone() for p in model.parameters()]

base = sys.argv[1]
ref = distributed(processes=2, output="none")(train).distributed(base + "/ref", False)
got = distributed(processes=2, max_restarts=1, heal=True, output="none")(train).distributed(
    base + "/healed", True
)
assert [tier for tier, _ in got] == ["live", "live"], got
for (_, a), (_, b) in zip(ref, got):
    assert all(torch.equal(x, y) for x, y in zip(a, b))
print("ok")
"""


def test_a_model_and_function_defined_in_main_heal_in_place(tmp_path, shm):
    import subprocess
    import sys

    script = tmp_path / "cell.py"
    script.write_text(CELL_DEFINED)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
    assert "healed in" in done.stdout + done.stderr
