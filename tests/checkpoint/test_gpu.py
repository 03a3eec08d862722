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


def _slot_rss_kb() -> int:
    """Resident kilobytes of every slot file this process maps (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = ".slot" in line
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def _cuda_run(width: int = 1024):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 8)
    ).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model, opt, seed):
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(16, model[0].in_features, device="cuda")).pow(2).mean().backward()
    opt.step()


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A snapshot base of the test's own for the memory tier."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(path))
    return path


def test_a_cuda_snapshot_goes_through_pinned_mirrors_and_holds_the_state_it_was_taken_at(
    tmp_path, shm
):
    model, opt = _cuda_run()
    with pytest.raises(RuntimeError):
        with CheckpointManager(tmp_path / "root", every=1000, memory_every=2) as ckpt:
            for step in range(1, 5):
                _step(model, opt, step)
                ckpt.maybe_save(step, model=model, optimizer=opt)
                if step == 2:
                    mirrors = list(ckpt._memory._mirrors._hosts)
                if step == 4:
                    # The next step is queued at once: it waits for the copy on the GPU.
                    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    _step(model, opt, 5)
            ckpt.wait()
            hosts = ckpt._memory._mirrors._hosts
            assert all(h is None or h.is_pinned() for h in hosts)
            assert [h.data_ptr() for h in hosts if h is not None] == [
                h.data_ptr() for h in mirrors if h is not None
            ]  # allocated once per layout
            raise RuntimeError("killed")
    fresh, fresh_opt = _cuda_run()
    with CheckpointManager(tmp_path / "root", memory_every=2) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 5
        assert again.restored_tier == "memory"
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, saved[name]), name


def test_a_restore_onto_the_gpu_keeps_no_page_of_the_slot_mapped(tmp_path, shm):
    model, opt = _cuda_run()
    with pytest.raises(RuntimeError):
        with CheckpointManager(tmp_path / "root", every=1000, memory_every=2) as ckpt:
            for step in range(1, 3):
                _step(model, opt, step)
                ckpt.maybe_save(step, model=model, optimizer=opt)
            raise RuntimeError("killed")
    fresh, fresh_opt = _cuda_run()  # default (foreach) Adam: step tensors stay on the CPU
    with CheckpointManager(tmp_path / "root", memory_every=2) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 3
        assert _slot_rss_kb() == 0
        for seed in range(10):
            _step(fresh, fresh_opt, seed)
        torch.cuda.synchronize()
        assert _slot_rss_kb() == 0
