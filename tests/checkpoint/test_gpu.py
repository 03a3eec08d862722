"""GPU-resident state: async saves stage through pinned host buffers (run on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from nbtools.checkpoint import CheckpointManager
from nbtools.checkpoint._host_buffers import ReusableStager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_staging_buffers_are_pinned_and_reused():
    stager = ReusableStager()
    state = {"w": torch.randn(1024, 1024, device="cuda"), "n": 3}
    first = stager.stage(state)
    assert first["w"].device.type == "cpu" and first["w"].is_pinned()
    assert torch.equal(first["w"], state["w"].cpu())
    state["w"].add_(1)
    second = stager.stage(state)
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert torch.equal(second["w"], state["w"].cpu())
    stager.close()


def test_cuda_model_round_trip_with_cuda_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(1, model=model, optimizer=opt)
    expected = torch.rand(3, device="cuda")
    fresh = torch.nn.Linear(64, 64).cuda()
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert CheckpointManager(tmp_path / "c").restore(model=fresh, optimizer=fresh_opt) == 2
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(torch.rand(3, device="cuda"), expected)  # CUDA stream restored
