"""Models built on the meta device: ``restore`` gives them storage, then loads a checkpoint into
them or, on a fresh start, initialises them; a restart never pays for a random init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbtools.checkpoint import CheckpointManager
from nbtools.errors import CheckpointError


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _steps(net: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(1000 + step)
        opt.zero_grad()
        net(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()


def _tensors(net: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(net.state_dict().values()) + [
        t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_meta_model_starts_as_a_cpu_built_one_and_resumes_without_its_init(tmp_path):
    torch.manual_seed(0)
    built = _net()
    ref_opt = torch.optim.Adam(built.parameters(), lr=1e-2)

    torch.manual_seed(0)
    with torch.device("meta"):
        net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)  # built on the meta parameters
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        assert ckpt.restore(model=net, optimizer=opt) == 0
        # Fresh start: each module's reset_parameters, in order, from the same seed.
        assert _same(list(net.state_dict().values()), list(built.state_dict().values()))
        assert all(p.device.type == "cpu" for p in net.parameters())
        assert all(b.device.type == "cpu" for b in net.buffers())
        # The optimizer holds the same parameter objects, now real: it trains them.
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in net.parameters()]
        _steps(net, opt, range(3))
        ckpt.save(2, model=net, optimizer=opt)
    _steps(built, ref_opt, range(3))
    assert _same(_tensors(net, opt), _tensors(built, ref_opt))

    inits: list[nn.Module] = []
    torch.manual_seed(123)  # a different seed: nothing of a fresh init may show through
    with torch.device("meta"):
        again = _net()
    again_opt = torch.optim.Adam(again.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        assert ckpt.restore(model=again, optimizer=again_opt, init=inits.append) == 3
        assert ckpt.restored_tier == "volume"
    assert inits == []  # restored: not initialised
    assert _same(_tensors(again, again_opt), _tensors(net, opt))
    _steps(again, again_opt, range(3, 5))
    _steps(built, ref_opt, range(3, 5))
    assert _same(_tensors(again, again_opt), _tensors(built, ref_opt))


def test_init_initialises_a_fresh_start_and_only_meta_tensors_get_storage(tmp_path):
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8, device="cpu")  # e.g. loaded from a file
            self.scale = nn.Parameter(torch.empty(8))  # no reset_parameters() of its own
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(x) * self.scale)

    with torch.device("meta"):
        net = Scaled()
    with torch.no_grad():
        net.embed.weight.copy_(torch.arange(80.0).reshape(10, 8))
    embed = net.embed.weight
    pointer = embed.data_ptr()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(model=net, optimizer=opt)
        message = str(info.value)
        assert "model (Scaled)" in message and "rank 0" in message and "init=" in message
        assert net.scale.is_meta  # refused before anything got storage

        def init(model: nn.Module) -> None:
            nn.init.ones_(model.scale)
            nn.init.zeros_(model.head.weight)
            nn.init.zeros_(model.head.bias)

        assert ckpt.restore(model=net, optimizer=opt, init=init) == 0
    assert net.embed.weight is embed and embed.data_ptr() == pointer
    assert torch.equal(embed, torch.arange(80.0).reshape(10, 8))
    assert torch.equal(net.scale, torch.ones(8))
    assert not net.head.weight.any() and not net.head.bias.any()
    net(torch.tensor([1, 2])).sum().backward()
    opt.step()  # the optimizer's parameters are the model's


def test_tied_parameters_stay_tied(tmp_path):
    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    net[1].weight = net[0].weight
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        assert ckpt.restore(model=net) == 0
        ckpt.save(0, model=net)
    assert net[1].weight is net[0].weight and not net[0].weight.is_meta
    with torch.device("meta"):
        again = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    again[1].weight = again[0].weight
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        assert ckpt.restore(model=again) == 1
    assert again[1].weight is again[0].weight
    assert torch.equal(again[0].weight, net[0].weight)


def test_a_non_persistent_buffer_on_the_meta_device_is_refused_before_anything_loads(tmp_path):
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("freqs", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), Rotary())
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(model=net)
        with pytest.raises(TypeError, match="init must be a callable"):
            ckpt.restore(model=net, init="ones")
    message = str(info.value)
    assert "model.1.freqs is a non-persistent buffer" in message
    assert "rank 0" in message and "device=" in message
    assert all(p.is_meta for p in net.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("memory_every", [2, None], ids=["memory", "volume"])
def test_ranks_built_on_the_meta_device_recover_from_a_kill_bit_exact(tmp_path, shm, memory_every):
    # The way large models are built: on the meta device on every attempt. The first
    # attempt starts fresh (reset_parameters), the restarted one restores; the result is
    # the uninterrupted run's, bit for bit.
    from nbtools import distributed

    @distributed(processes=2, max_restarts=1, output="none")
    def train(root, memory_every):
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        with torch.device("meta"):
            net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        with CheckpointManager(root, every=4, memory_every=memory_every) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 10):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(4, 64)).pow(2).mean().backward()
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 7 and dist.get_rank() == 1 and get_restart_count() == 0:
                    ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
        tensors = list(net.state_dict().values())
        tensors += [t for s in opt.state.values() for t in s.values()]
        return get_restart_count(), ckpt.restored_step, ckpt.restored_tier, tensors

    results = train.distributed(str(tmp_path / "root"), memory_every)
    expected = (1, 6, "memory") if memory_every else (1, 4, "volume")
    assert [r[:3] for r in results] == [expected, expected]

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(10):
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
    for result in results:
        assert _same(result[3], _tensors(net, opt))
    assert not any(p.is_file() for p in shm.rglob("*"))
