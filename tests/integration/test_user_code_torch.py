"""Plain PyTorch code from notebook cells, unchanged, inside ``@distributed(processes=2)``.

Datasets, helpers and closures are defined in cells of a real kernel (or
inside the decorated function), so they reach the ranks by value, and the
ranks' loader workers must be able to run them, as they do in a plain notebook.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        nb.run(
            textwrap.dedent("""\
            import os
            import numpy as np
            import torch
            from torch.utils.data import Dataset, IterableDataset, get_worker_info
            from nbtools import distributed
        """)
        )
        yield nb


def test_cell_defined_iterable_dataset_over_volume_with_workers_ddp_and_checkpoints(
    kernel, tmp_path
):
    kernel.run(
        textwrap.dedent(f"""\
        VOLUME, CACHE, CKPT = {str(tmp_path / "volume")!r}, {str(tmp_path / "cache")!r}, {str(tmp_path / "ckpt")!r}
        os.makedirs(VOLUME)
        for i in range(64):
            np.array([i, i / 64, 1.0, -1.0, 0.5], dtype=np.float32).tofile(os.path.join(VOLUME, f"{{i:03d}}.bin"))
    """)
    )
    kernel.run(
        textwrap.dedent("""\
        def decode(path):                       # a helper from a cell, called in the loader workers
            row = np.fromfile(path, dtype=np.float32)
            return int(row[0]), torch.from_numpy(row[1:])


        class Samples(IterableDataset):         # defined in the notebook: lives in __main__
            def __init__(self, files):
                self.files = files

            def __iter__(self):
                worker = get_worker_info()
                for path in self.files:
                    i, x = decode(path)
                    yield i, -1 if worker is None else worker.id, x


        @distributed(processes=2)
        def train(stop_after=None):
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            from nbtools.checkpoint import CheckpointManager
            from nbtools.data import DataLoader, VolumeDataset

            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Linear(4, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            files = VolumeDataset(VOLUME, cache_dir=CACHE, shuffle=True, seed=0)
            loader = DataLoader(Samples(files), batch_size=4, num_workers=2)
            seen, workers = [], set()
            with CheckpointManager(CKPT, every=2) as ckpt:
                step = start = ckpt.restore(model=model, optimizer=optimizer, data=loader)
                for ids, worker_ids, x in loader:
                    loss = model(x).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    seen += ids.tolist()
                    workers |= set(worker_ids.tolist())
                    ckpt.maybe_save(step, model=model, optimizer=optimizer, data=loader)
                    if step == stop_after:
                        break
                    step += 1
            loader.close()
            return dict(rank=dist.get_rank(), world=dist.get_world_size(), start=start, seen=seen,
                        workers=sorted(workers), weight=model.module.weight.flatten().tolist())
    """)
    )
    first = kernel.eval("train.distributed(stop_after=4)")  # stops after step 4, which is saved
    second = kernel.eval("train.distributed()")  # a new launch resumes at step 5

    for results in (first, second):
        assert [r["rank"] for r in results] == [0, 1]
        assert all(r["world"] == 2 for r in results)
        assert all(r["workers"] == [0, 1] for r in results), (
            "both loader workers of each rank served data"
        )
        assert results[0]["weight"] == results[1]["weight"], "DDP keeps the replicas equal"
    assert [r["start"] for r in first] == [0, 0]
    assert [r["start"] for r in second] == [5, 5]
    assert all(len(r["seen"]) == 5 * 4 for r in first)
    ids = [i for r in first + second for i in r["seen"]]
    assert sorted(ids) == list(range(64)), "the epoch is seen exactly once across the resume"
    saved = {p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")}
    assert {"step_0", "step_2", "step_4", "step_6"} <= saved


def test_map_style_dataset_from_the_function_with_torch_loader_workers_and_sampler(kernel):
    kernel.run(
        textwrap.dedent("""\
        scale = lambda t: 2 * t                 # a closure from a cell, called in the workers


        @distributed(processes=2)
        def epochs(n):
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            class Squares(Dataset):             # defined inside the function sent to the ranks
                def __len__(self):
                    return 40

                def __getitem__(self, i):
                    return i, get_worker_info().id, scale(torch.tensor(float(i)))

            sampler = DistributedSampler(Squares(), shuffle=True, seed=0)
            loader = DataLoader(Squares(), batch_size=5, sampler=sampler, num_workers=2)
            out = []
            for epoch in range(n):
                sampler.set_epoch(epoch)
                ids, workers = [], set()
                for i, w, x in loader:
                    assert torch.equal(x, 2 * i.float())
                    ids += i.tolist()
                    workers |= set(w.tolist())
                out.append(dict(ids=ids, workers=sorted(workers)))
            return dict(rank=dist.get_rank(), world=dist.get_world_size(), epochs=out)
    """)
    )
    results = kernel.eval("epochs.distributed(2)")

    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    for epoch in range(2):
        halves = [r["epochs"][epoch]["ids"] for r in results]
        assert [len(h) for h in halves] == [20, 20]
        assert sorted(halves[0] + halves[1]) == list(range(40)), "the sampler splits the data"
        assert all(r["epochs"][epoch]["workers"] == [0, 1] for r in results)
    assert results[0]["epochs"][0]["ids"] != results[0]["epochs"][1]["ids"], "set_epoch reshuffles"
