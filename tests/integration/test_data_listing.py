"""Listing a volume once per job, through a FUSE mount that counts what it lists (root + FUSE)."""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from nbtools.data import DataLoader, VolumeDataset

_HERE = os.path.dirname(__file__)
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.normpath(os.path.join(_HERE, "..", "data")))
from _data_helpers import Indices, content, make_tree  # noqa: E402
from test_data_fuse import mounted  # noqa: E402

N_FILES = 60
DIRS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, root: str, phase: str, world: int, workers: int, port: int, take: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        files = VolumeDataset(f"{root}/mnt", cache_dir=f"{root}/cache", shuffle=True, seed=1)
        with DataLoader(Indices(files), batch_size=2, num_workers=workers) as loader:
            saved = f"{root}/state.json"
            if phase == "resume":
                with open(saved) as fh:
                    loader.load_state_dict(json.load(fh))
            seen: list[int] = []
            for batch in loader:
                seen += batch.tolist()
                if take and len(seen) >= take:
                    break
            state = loader.state_dict()
        if rank == 0 and phase == "first":
            with open(saved, "w") as fh:
                json.dump(state, fh)
    finally:
        dist.destroy_process_group()
    with open(f"{root}/{phase}-{rank}.json", "w") as fh:
        json.dump(seen, fh)


def _launch(root, phase: str, world: int, workers: int, take: int = 0) -> list[int]:
    counts = root / "counts.txt"
    counts.write_text("")
    mp.start_processes(
        _rank,
        args=(str(root), phase, world, workers, _free_port(), take),
        nprocs=world,
        start_method="fork",
        join=True,
    )
    seen = []
    for r in range(world):
        seen += json.loads((root / f"{phase}-{r}.json").read_text())
    return seen


def _listed(root) -> collections.Counter:
    return collections.Counter((root / "counts.txt").read_text().split())


@pytest.mark.root
@pytest.mark.slow
def test_two_ranks_list_each_directory_once_then_never_until_the_volume_changes(tmp_path):
    src = tmp_path / "src"
    make_tree(src, N_FILES, dirs=DIRS)
    past = time.time() - 3600  # written a while ago
    for d in [src, *(src / f"d{k}" for k in range(DIRS))]:
        os.utime(d, (past, past))
    every_dir = {"/", *(f"/d{k}" for k in range(DIRS))}
    # No attribute cache in the kernel: a change made on the source is visible at once.
    options = (
        "--open-ms",
        "0",
        "--read-ms",
        "0",
        "--attr-timeout",
        "0",
        "--counts",
        str(tmp_path / "counts.txt"),
    )
    with mounted(src, tmp_path / "mnt", *options):
        first = _launch(tmp_path, "first", world=2, workers=2, take=6)
        assert _listed(tmp_path) == {d: 1 for d in every_dir}, "one listing per job"

        # Another launch, another world size and number of workers: nothing listed,
        # and the rest of the epoch completes it exactly once.
        rest = _launch(tmp_path, "resume", world=1, workers=3)
        assert _listed(tmp_path) == {}
        assert sorted(first + rest) == list(range(N_FILES))

        (src / "d1" / "f00060.bin").write_bytes(content(60, 64))  # added
        os.unlink(src / "d2" / "f00002.bin")  # removed
        again = _launch(tmp_path, "changed", world=2, workers=2)
        assert _listed(tmp_path) == {d: 1 for d in every_dir}
        assert sorted(again) == [i for i in range(N_FILES + 1) if i != 2]
