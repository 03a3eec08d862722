"""VolumeDataset + DataLoader on two real gloo ranks: partitioning, identical state, resume."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from nbtools.data import DataLoader, VolumeDataset
from nbtools.errors import DataError

_HELPERS = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "data"))
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
from _data_helpers import Indices, make_tree  # noqa: E402

N_FILES = 37


def _loader(root, workers):
    files = VolumeDataset(root / "src", cache_dir=root / "cache", shuffle=True, seed=3)
    return DataLoader(Indices(files), batch_size=3, num_workers=workers)


def _rank_main(rank: int, root_str: str, phase: str) -> None:
    from pathlib import Path

    root = Path(root_str)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store-{phase}", rank=rank, world_size=2
    )
    out: dict = {}
    try:
        if phase == "run":
            # Ranks that disagree on num_workers fail together at the start of iteration.
            with _loader(root, 1 + rank) as bad:
                try:
                    iter(bad)
                except DataError as exc:
                    out["mismatch"] = str(exc)
            with _loader(root, 2) as loader:
                seen = []
                for batch in loader:
                    seen += batch.tolist()
                    if len(seen) >= 9:
                        break
                out["seen"] = seen
                out["state"] = loader.state_dict()
        else:
            state = json.loads((root / "state.json").read_text())
            with _loader(root, 1) as resumed:
                resumed.load_state_dict(state)
                out["rest"] = [i for b in resumed for i in b.tolist()]
                out["next"] = [i for b in resumed for i in b.tolist()]
            with _loader(root, 1) as fresh:
                fresh.dataset.files.set_epoch(1)
                out["reference_next"] = [i for b in fresh for i in b.tolist()]
    finally:
        dist.destroy_process_group()
    (root / f"{phase}-{rank}.json").write_text(json.dumps(out))


def _spawn(root, phase):
    mp.start_processes(
        _rank_main, args=(str(root), phase), nprocs=2, start_method="fork", join=True
    )
    return [json.loads((root / f"{phase}-{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_ranks_partition_save_identical_state_and_resume_with_any_world_size(tmp_path):
    make_tree(tmp_path / "src", N_FILES)
    ranks = _spawn(tmp_path, "run")
    for out in ranks:
        assert "rank 0: 1, rank 1: 2" in out["mismatch"]
    assert ranks[0]["state"] == ranks[1]["state"], "every rank must save the same position"
    seen = ranks[0]["seen"] + ranks[1]["seen"]
    assert len(seen) == len(set(seen)), "ranks served a file twice"
    state = ranks[0]["state"]
    (tmp_path / "state.json").write_text(json.dumps(state))

    # Resume on 2 ranks with 1 worker each: the rest of the epoch exactly once,
    # then the same next epoch as a run that was never interrupted.
    resumed = _spawn(tmp_path, "resume")
    rest = resumed[0]["rest"] + resumed[1]["rest"]
    assert sorted(seen + rest) == list(range(N_FILES))
    for out in resumed:
        assert out["next"] == out["reference_next"]

    # Resume the same state in one process (a notebook, no process group).
    with _loader(tmp_path, 0) as single:
        single.load_state_dict(state)
        alone = [i for b in single for i in b.tolist()]
    assert sorted(seen + alone) == list(range(N_FILES))
    assert not dist.is_initialized()


def _wide_rank(rank: int, root_str: str, phase: str, world: int, workers: int) -> None:
    from pathlib import Path

    root = Path(root_str)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store-{phase}", rank=rank, world_size=world
    )
    out: dict = {}
    try:
        files = VolumeDataset(root / "src", cache_dir=root / "cache", shuffle=True, seed=5)
        with DataLoader(Indices(files), batch_size=4, num_workers=workers) as loader:
            if phase == "resume":
                loader.load_state_dict(json.loads((root / "state.json").read_text()))
            seen: list[int] = []
            for batch in loader:
                seen += batch.tolist()
                if phase == "run" and len(seen) >= 20 + 4 * (rank % 3):  # uneven progress
                    break
            out = {"seen": seen, "state": loader.state_dict()}
    finally:
        dist.destroy_process_group()
    (root / f"{phase}-{rank}.json").write_text(json.dumps(out))


def _spawn_wide(root, phase: str, world: int, workers: int) -> list[dict]:
    mp.start_processes(
        _wide_rank,
        args=(str(root), phase, world, workers),
        nprocs=world,
        start_method="fork",
        join=True,
    )
    return [json.loads((root / f"{phase}-{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_eight_ranks_stop_unevenly_and_three_ranks_with_two_workers_finish_exactly_once(tmp_path):
    n = 1000
    make_tree(tmp_path / "src", n, dirs=10)
    ranks = _spawn_wide(tmp_path, "run", world=8, workers=1)
    states = [out["state"] for out in ranks]
    assert all(s == states[0] for s in states), "every rank must save the same position"
    seen = [i for out in ranks for i in out["seen"]]
    assert len(seen) == len(set(seen)) == sum(20 + 4 * (r % 3) for r in range(8))
    (tmp_path / "state.json").write_text(json.dumps(states[0]))

    resumed = _spawn_wide(tmp_path, "resume", world=3, workers=2)
    rest = [i for out in resumed for i in out["seen"]]
    assert sorted(seen + rest) == list(range(n)), "the rest of the epoch, each file once"
