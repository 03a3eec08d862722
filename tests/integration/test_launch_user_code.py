"""Users' own code inside ranks behaves as in a plain notebook: loader workers, accelerate, groups."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from nbtools.launch import _env, distributed


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start the interpreter-owned forkserver before the per-test leak checks begin."""
    _env.warm_up()


def test_loader_workers_take_classes_defined_inside_the_function():
    @distributed(processes=2, output="none")
    def load():
        import multiprocessing

        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader, Dataset, DistributedSampler

        from nbtools.data import DataLoader as NbLoader

        # torch's hint for notebooks, called first as in a kernel, must work there too.
        multiprocessing.set_start_method("fork")

        class Squares(Dataset):  # defined here, as in a notebook cell: not importable
            def __len__(self):
                return 16

            def __getitem__(self, index):
                return torch.tensor([index * index])

        scale = 3
        seen = {}
        dataset = Squares()
        sampler = DistributedSampler(dataset, shuffle=False)
        loader = DataLoader(
            dataset,
            batch_size=4,
            num_workers=2,
            sampler=sampler,
            collate_fn=lambda batch: torch.cat(batch) * scale,  # a closure, too
        )
        seen["torch"] = sorted(int(v) for batch in loader for v in batch)
        with NbLoader(Squares(), batch_size=4, num_workers=2) as nb_loader:
            seen["nbtools"] = sorted(int(v) for batch in nb_loader for v in batch)
        seen["method"] = multiprocessing.get_start_method()
        seen["rank"] = dist.get_rank()
        return seen

    results = load.distributed()
    expected_all = sorted(3 * i * i for i in range(16))
    assert sorted(results[0]["torch"] + results[1]["torch"]) == expected_all
    assert results[0]["torch"] and results[1]["torch"]
    assert all(r["nbtools"] == sorted(i * i for i in range(16)) for r in results)
    assert all(r["method"] == "fork" for r in results)


SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, Dataset, DistributedSampler
    from nbtools import distributed

    class Rows(Dataset):  # lives in a real __main__, like a class from a notebook cell
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return index

    @distributed(processes=2, output="none")
    def load():
        dataset = Rows()
        loader = DataLoader(dataset, batch_size=2, num_workers=2,
                            sampler=DistributedSampler(dataset, shuffle=False))
        return [int(v) for batch in loader for v in batch]

    print("RESULT", sorted(sum(load.distributed(), [])), flush=True)
    """
)


def test_loader_workers_take_classes_from_the_main_module(tmp_path):
    script = tmp_path / "cell.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT [0, 1, 2, 3, 4, 5, 6, 7]" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_plain_accelerator_is_distributed_in_cpu_ranks():
    @distributed(processes=2, output="none")
    def prepare():
        import torch
        from accelerate import Accelerator

        accelerator = Accelerator()
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = torch.utils.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=2)
        model, optimizer, rows = accelerator.prepare(model, optimizer, rows)
        return (
            accelerator.num_processes,
            accelerator.process_index,
            accelerator.distributed_type.value,
            len(list(rows)),
        )

    results = prepare.distributed()
    assert [r[:2] for r in results] == [(2, 0), (2, 1)]
    assert all(r[2] == "MULTI_CPU" for r in results)
    assert all(r[3] == 2 for r in results)  # half of the 4 batches each


def test_a_users_nccl_group_in_cpu_ranks_is_skipped_with_one_warning(capfd):
    @distributed(processes=2)
    def own_nccl_group():
        import torch
        import torch.distributed as dist

        dist.init_process_group(backend="nccl")
        dist.init_process_group(backend="nccl")  # warned once, not twice
        dist.init_process_group(backend="gloo")  # matches the group: silent
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_backend(), t.item()

    assert own_nccl_group.distributed() == [("gloo", 2.0), ("gloo", 2.0)]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "init_process_group(" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("[rank 0] ")
    assert "'nccl'" in lines[0] and "'gloo'" in lines[0] and "gpus=N" in lines[0]
