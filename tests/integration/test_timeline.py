"""A run that loses a rank leaves its whole timeline on the pane, from every rank, in order.

Two gloo ranks train a DDP model on ``VolumeDataset``/``DataLoader`` data with
async ``CheckpointManager`` saves; the dataset wrapper and the training code
are defined inside the function, as in a notebook cell. On the first attempt
one sample is slow to read (an input stall) and rank 1 SIGKILLs itself after a
checkpoint was published; the group restarts from it and finishes. The pane
open in the kernel must then hold, in time order: ``launch``,
``checkpoint_saved`` (with the seconds the loop was blocked), ``rank_failed``
naming rank 1, ``restart``, ``checkpoint_restored``, ``finished``, plus an
``input_stall`` and a user event from each rank of each attempt.
"""

from __future__ import annotations

import pytest

from nbtools import distributed, events
from nbtools.launch import _env
from nbtools.monitor import GPUPane, SimulatedBackend

pytest.importorskip("anywidget", reason="the pane's chart needs anywidget")
pytestmark = pytest.mark.slow

SAMPLES, KILL_AT, SLOW_AT = 32, 5, 9  # 8 steps of 2 samples per rank; the 5th batch is slow


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start the interpreter-owned forkserver before the per-test leak checks begin."""
    _env.warm_up()


def test_a_run_that_loses_a_rank_leaves_its_timeline_on_the_pane(tmp_path):
    src = tmp_path / "volume"
    src.mkdir()
    for i in range(SAMPLES):
        (src / f"{i:03d}.txt").write_text(str(i))

    @distributed(processes=2, max_restarts=1, output="none")
    def train(src: str, cache: str, root: str, kill_at: int, slow_at: int) -> dict:
        import os
        import signal
        import time

        import torch
        import torch.distributed as dist
        from torch.utils.data import IterableDataset

        from nbtools import events
        from nbtools.checkpoint import CheckpointManager
        from nbtools.data import DataLoader, VolumeDataset
        from nbtools.runtime import get_restart_count

        attempt, rank = get_restart_count(), dist.get_rank()

        class Numbers(IterableDataset):
            """Reads one number per file, in the order the volume dataset yields them."""

            def __init__(self, files):
                self.files = files

            def __iter__(self):
                for position, path in enumerate(self.files):
                    if position == slow_at and attempt == 0:
                        time.sleep(1.5)  # a slow read on the volume
                    with open(path) as fh:
                        yield torch.tensor([float(fh.read())])

            def state_dict(self):
                return self.files.state_dict()

            def load_state_dict(self, state):
                self.files.load_state_dict(state)

        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        files = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=0)
        loader = DataLoader(Numbers(files), batch_size=2, num_workers=0)
        with CheckpointManager(root, every=2) as ckpt:
            step = ckpt.restore(model=model, optimizer=optimizer, data=loader)
            events.emit(
                "rank_started",
                message=f"rank {rank}, attempt {attempt}",
                step=step,
                attempt=attempt,
            )
            for batch in loader:
                loss = model(batch).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                ckpt.maybe_save(step, model=model, optimizer=optimizer, data=loader)
                if attempt == 0 and step == kill_at:
                    ckpt.wait()  # the checkpoint before the kill is published...
                    events.flush()  # ...and its event is on its way
                    dist.barrier()
                    if rank == 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                step += 1
        return {"rank": rank, "attempt": attempt, "restored": ckpt.restored_step, "steps": step}

    events.bus().clear()
    pane = GPUPane(interval=60, idle_timeout=None, backend=SimulatedBackend(1), display=False)
    try:
        results = train.distributed(
            str(src), str(tmp_path / "cache"), str(tmp_path / "ckpt"), KILL_AT, SLOW_AT
        )
        timeline = pane.events()
        rows = timeline if isinstance(timeline, list) else timeline.to_dict("records")
    finally:
        pane.close()
        events.bus().clear()

    assert [r["attempt"] for r in results] == [1, 1]
    assert results[0]["restored"] is not None and results[0]["steps"] == SAMPLES // 4
    kinds = [r["kind"] for r in rows]

    def first(kind: str, **match) -> dict:
        found = [
            r for r in rows if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())
        ]
        assert found, f"no {kind} {match or ''} event among {kinds}"
        return found[0]

    launch = first("launch")
    saved = first("checkpoint_saved")
    failed = first("rank_failed", rank=1)
    restart = first("restart")
    restored = first("checkpoint_restored")
    finished = first("finished")
    order = [launch, saved, failed, restart, restored, finished]
    assert [r["time"] for r in order] == sorted(r["time"] for r in order), kinds
    assert saved["step"] is not None and saved.get("blocked_s", -1) >= 0
    assert restored["step"] == results[0]["restored"]

    stalls = [r for r in rows if r["kind"] == "input_stall"]
    assert {r["rank"] for r in stalls} == {0, 1} and min(r["seconds"] for r in stalls) >= 1.0
    started = {(r["rank"], r["attempt"]) for r in rows if r["kind"] == "rank_started"}
    assert started == {(0, 0), (1, 0), (0, 1), (1, 1)}
