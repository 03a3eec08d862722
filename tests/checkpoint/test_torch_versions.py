"""Checkpoints written with the oldest supported torch load with the torch under test.

The files under ``data/torch<version>/`` were written by
``data/make_old_checkpoints.py`` running on that torch. The metadata names
private torch classes (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ...) by their
module paths; loading them here checks that the restricted unpickler admits the
paths every supported torch writes.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools._torch_compat import TESTED_TORCH
from nbtools.checkpoint import CheckpointManager, VolumeReader, latest_checkpoint

DATA = Path(__file__).parent / "data"
OLDEST = DATA / f"torch{TESTED_TORCH[0]}"


def _maker():
    spec = importlib.util.spec_from_file_location(
        "make_old_checkpoints", DATA / "make_old_checkpoints.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def oldest(tmp_path):
    """A copy of the oldest torch's checkpoints (tests never write into the repository)."""
    assert OLDEST.is_dir(), (
        f"{OLDEST} is missing: run {DATA / 'make_old_checkpoints.py'} on that torch"
    )
    return Path(shutil.copytree(OLDEST, tmp_path / OLDEST.name))


def test_manager_checkpoint_of_oldest_torch_restores(oldest):
    maker = _maker()
    saved_model = maker.make_model()
    saved_opt = maker.make_optimizer(saved_model)

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert latest_checkpoint(oldest / "manager") == (3, str(oldest / "manager" / "step_3"))
    with CheckpointManager(oldest / "manager", save_on_close=False) as ckpt:
        assert ckpt.restore(model=model, optimizer=opt) == 4
        assert ckpt.extra["written_by"].startswith(TESTED_TORCH[0])
    torch.testing.assert_close(model.state_dict(), saved_model.state_dict())
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    expected = [saved_opt.state[p]["momentum_buffer"] for p in saved_model.parameters()]
    torch.testing.assert_close(momentum, expected)


def test_pytorch_checkpoint_of_oldest_torch_loads_through_volume_reader(oldest):
    expected = _maker().expected_state()
    state = {"w": torch.zeros(2, 3, dtype=torch.float64), "step": 0, "name": ""}
    dcp.load(state, storage_reader=VolumeReader(oldest / "dcp"), no_dist=True)
    torch.testing.assert_close(state["w"], expected["w"])
    assert (state["step"], state["name"]) == (expected["step"], expected["name"])
