"""Staged restores on real gloo ranks of one node: each record staged once per node.

On GPU ranks no destination is a dense CPU tensor, so every record handed over
goes to local staging. Here CPU destinations made non-dense (transposed and
strided views) stand in for them. Each rank counts, whenever the load commits a
tensor, the files and bytes (blocks allocated) in every staging directory under
the staging base, so the staged copies are counted on the disk itself.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools import distributed
from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.errors import StagingSpaceError
from nbtools.launch import _env

pytestmark = pytest.mark.slow

MiB = 1 << 20


def _make_restore():
    # Made inside a function, so that it travels to the ranks by value, like cell code.
    def restore(
        path: str, staging: str, names: list[str], shapes: dict, device: str = "cpu"
    ) -> dict:
        """Load ``names`` of the checkpoint at ``path`` into non-dense CPU tensors (or, with
        ``device="cuda"``, into CUDA tensors), staged under ``staging``; the values and what
        the staging directories held."""
        from torch.distributed.checkpoint import DefaultLoadPlanner

        seen: dict[str, tuple[int, int]] = {}

        def count() -> None:
            for entry in os.scandir(staging):
                if not entry.is_dir():
                    continue
                files = nbytes = 0
                for root, dirs, found in os.walk(entry.path):
                    dirs[:] = [d for d in dirs if not d.startswith(".")]  # claims
                    for name in found:
                        if name.startswith("."):
                            continue  # the marks of who is inside
                        files += 1
                        nbytes += os.stat(os.path.join(root, name)).st_blocks * 512
                old = seen.get(entry.name, (0, 0))
                seen[entry.name] = (max(old[0], files), max(old[1], nbytes))

        class Counting(DefaultLoadPlanner):
            def commit_tensor(self, read_item, tensor):
                count()
                super().commit_tensor(read_item, tensor)

        state = {}
        for name in names:
            rows, cols = shapes[name]
            if device == "cpu":
                # Transposed: the right shape, not contiguous, as a CUDA tensor is not dense CPU.
                state[name] = torch.zeros(cols, rows).t()
            else:
                state[name] = torch.zeros(rows, cols, device=device)
        reader = VolumeReader(path, stage=True, staging_dir=staging)
        dcp.load(state, storage_reader=reader, planner=Counting())
        return {"values": {k: v.cpu().clone() for k, v in state.items()}, "seen": seen}

    return restore


_restore = _make_restore()

_SHAPES = {f"w{i}": (256, 1024) for i in range(8)}  # 1 MiB each


def _value(name: str) -> torch.Tensor:
    rows, cols = _SHAPES[name]
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + int(name[1:])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    _env.warm_up()  # the interpreter-owned forkserver, before any per-test leak check
    path = str(tmp_path_factory.mktemp("node") / "ckpt")
    state = {name: _value(name) for name in _SHAPES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs in a single process
        dcp.save(state, storage_writer=VolumeWriter(path))
    return path


def _data_files(path: str) -> int:
    return sum(1 for n in os.listdir(path) if n != ".metadata")


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n != ".metadata")


def test_ranks_of_a_node_stage_each_record_once(saved, tmp_path):
    @distributed(processes=3)
    def job(path: str, shared: str, private: str, restore, shapes: dict) -> dict:
        import torch.distributed as dist

        names = sorted(shapes)
        rank = dist.get_rank()
        together = restore(path, shared, names, shapes)
        # Each rank on a staging disk of its own: every rank stages every record.
        apart = restore(path, os.path.join(private, str(rank)), names, shapes)
        return {"together": together, "apart": apart}

    shared, private = tmp_path / "shared", tmp_path / "private"
    facts = job.distributed(saved, str(shared), str(private), _restore, _SHAPES)
    size = _data_bytes(saved)
    for rank_facts in facts:
        for how in ("together", "apart"):
            for name, value in rank_facts[how]["values"].items():
                assert torch.equal(value, _value(name)), (how, name)
    # One directory for the node, which holds each record once.
    together = {d: fb for f in facts for d, fb in f["together"]["seen"].items()}
    assert len(together) == 1, together
    ((files, nbytes),) = together.values()
    assert files == _data_files(saved) and size <= nbytes <= size + MiB
    # Per rank: three copies of everything.
    apart = {(r, d): fb for r, f in enumerate(facts) for d, fb in f["apart"]["seen"].items()}
    assert len(apart) == 3
    assert sum(nb for _, nb in apart.values()) >= 3 * size
    # Every staging directory is gone afterwards.
    assert os.listdir(shared) == []
    assert all(os.listdir(private / str(r)) == [] for r in range(3))


def test_one_space_check_covers_the_node(saved, mount_tmpfs):
    # Each rank alone stages 4 MiB and keeps 16 MiB free (it would fit); the node
    # stages 8 MiB, which with the reserve does not.
    disk = mount_tmpfs("22m")

    @distributed(processes=2)
    def job(path: str, staging: str, restore, shapes: dict) -> str:
        import torch.distributed as dist
        from torch.distributed.checkpoint.api import CheckpointException

        names = sorted(shapes)
        half = names[dist.get_rank() :: 2]  # disjoint halves: 4 MiB per rank, 8 per node
        try:
            restore(path, staging, half, shapes)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            inner = next(iter(getattr(exc, "failures", {}).values()), exc)
            inner = inner[0] if isinstance(inner, tuple) else inner
            return f"{type(inner).__name__}: {inner}"
        return "no error"

    errors = job.distributed(saved, str(disk), _restore, _SHAPES)
    for error in errors:
        assert error.startswith(StagingSpaceError.__name__), error
        assert "rank(s) 0, 1" in error and "8.0 MiB of local staging" in error
    assert os.listdir(disk) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ranks_of_a_node_stage_each_record_once(saved, tmp_path):
    # Two CPU-group ranks whose state lives on cuda:0: every record handed over is staged.
    @distributed(processes=2)
    def job(path: str, staging: str, restore, shapes: dict) -> dict:
        return restore(path, staging, sorted(shapes), shapes, device="cuda:0")

    facts = job.distributed(saved, str(tmp_path / "stage"), _restore, _SHAPES)
    for rank_facts in facts:
        for name, value in rank_facts["values"].items():
            assert torch.equal(value, _value(name)), name
    dirs = {d: fb for f in facts for d, fb in f["seen"].items()}
    assert len(dirs) == 1, dirs
    ((files, nbytes),) = dirs.values()
    size = _data_bytes(saved)
    assert files == _data_files(saved) and size <= nbytes <= size + MiB
