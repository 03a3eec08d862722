"""Trainers' wrappers given to ``CheckpointManager``: the ones it understands are taken as
they are, any other is refused at the first ``maybe_save``, naming the wrapper and what
to pass instead, before a checkpoint that could never be restored is written."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from _user_code_nb import NotebookKernel, requires

from nbtools.checkpoint import CheckpointManager
from nbtools.errors import CheckpointError


def _data(n: int = 12) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(n))


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


class _Lookahead(torch.optim.SGD):
    """An optimizer that steps another one of its own, keeping a state apart."""

    def __init__(self, params, inner: torch.optim.Optimizer) -> None:
        super().__init__(params, lr=0.1)
        self.optimizer = inner


def test_an_optimizer_wrapping_another_with_a_state_apart_is_refused_at_the_first_call(
    tmp_path,
):
    net = _net()
    opt = _Lookahead(net.parameters(), torch.optim.AdamW(net.parameters()))
    with CheckpointManager(tmp_path / "ckpt", every=100, async_save=False) as ckpt:
        with pytest.raises(CheckpointError) as caught:
            ckpt.maybe_save(1, model=net, optimizer=opt)  # no save due at step 1
    message = str(caught.value)
    assert "optimizer=_Lookahead wraps the optimizer AdamW without sharing its state" in message
    assert "pass optimizer=<your _Lookahead>.optimizer instead" in message
    assert not list((tmp_path / "ckpt").glob("step_*"))


@requires("lightning")
def test_fabric_loader_over_a_loader_without_a_position_is_refused_naming_what_to_use(tmp_path):
    before = dict(os.environ)
    from lightning.fabric.wrappers import _FabricDataLoader

    os.environ.clear()  # the import sets a variable of its own
    os.environ.update(before)

    loader = _FabricDataLoader(torch.utils.data.DataLoader(_data(), batch_size=2))
    with CheckpointManager(tmp_path / "ckpt", every=100, async_save=False) as ckpt:
        with pytest.raises(TypeError) as caught:
            ckpt.maybe_save(1, data=loader)
    message = str(caught.value)
    assert "data=_FabricDataLoader wraps a DataLoader, which keeps no position" in message
    assert "StatefulDataLoader" in message


@requires("accelerate")
@pytest.mark.parametrize("saved_after", [3, 6], ids=["mid-pass", "end-of-pass"])
def test_accelerate_prepared_loader_resumes_in_the_order_of_the_whole_run(tmp_path, saved_after):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    passes, per_pass = 3, 6

    def prepared():
        torch.manual_seed(7)
        loader = torch.utils.data.DataLoader(_data(), batch_size=2, shuffle=True)
        return accelerator.prepare(loader)

    def step(batch, out):  # a batch, then what training on it draws from torch's generator
        out.append((batch[0].tolist(), torch.rand(1).item()))

    def train(loader, out):
        while len(out) < passes * per_pass:
            for batch in loader:
                step(batch, out)

    whole = prepared()
    expected: list = []
    with CheckpointManager(tmp_path / "whole", every=100, async_save=False) as ckpt:
        ckpt.restore(data=whole)
        train(whole, expected)

    first = prepared()
    seen: list = []
    with CheckpointManager(tmp_path / "ckpt", every=100, async_save=False) as ckpt:
        ckpt.restore(data=first)
        for batch in first:
            step(batch, seen)
        batches = iter(first)
        for _ in range(saved_after):
            step(next(batches), seen)
        ckpt.save(len(seen) - 1, data=first)
        del batches
    torch.manual_seed(99)  # a restarted process's generator: the restore puts it back
    again = prepared()
    with CheckpointManager(tmp_path / "ckpt", every=100, async_save=False) as ckpt:
        assert ckpt.restore(data=again) == len(seen)
        train(again, seen)
    assert seen == expected
    assert sorted(i for batch, _ in seen[per_pass : 2 * per_pass] for i in batch) == list(range(12))


@pytest.mark.slow
@pytest.mark.kernel
def test_a_model_wrapper_not_understood_fails_the_first_maybe_save_in_a_notebook(tmp_path):
    with NotebookKernel(tmp_path) as nb:
        nb.run(
            textwrap.dedent(
                """\
                import torch
                from nbtools.checkpoint import CheckpointManager


                class Wrapped(torch.nn.Module):
                    # Hands attribute access and its state to the model it wraps.
                    def __init__(self, net):
                        super().__init__()
                        self.inner = net

                    def forward(self, x):
                        return self.inner(x)

                    def __getattr__(self, name):
                        try:
                            return super().__getattr__(name)
                        except AttributeError:
                            return getattr(self.inner, name)

                    def state_dict(self, *args, **kwargs):
                        return self.inner.state_dict(*args, **kwargs)

                    def load_state_dict(self, *args, **kwargs):
                        return self.inner.load_state_dict(*args, **kwargs)
                """
            )
        )
        output = nb.run(
            textwrap.dedent(
                f"""\
                net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
                model = Wrapped(net)
                opt = torch.optim.AdamW(model.parameters())
                ckpt = CheckpointManager({str(tmp_path / "ckpt")!r}, every=100)
                try:
                    ckpt.maybe_save(1, model=model, optimizer=opt)  # no save due at step 1
                except Exception as exc:
                    print(type(exc).__name__, exc)
                ckpt.maybe_save(2, model=net, optimizer=opt)  # what the message says works
                ckpt.close()
                """
            )
        )
    assert "CheckpointError model=Wrapped is a wrapper nbtools does not understand" in output
    assert "'inner.0.weight' is not in it" in output
    assert "Pass model=<your Wrapped>.inner instead" in output
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_2"]


@requires("accelerate")
def test_accelerate_loader_first_given_in_the_middle_of_a_pass_says_the_pass_restarts(
    tmp_path, caplog
):
    import logging

    from accelerate import Accelerator

    loader = Accelerator(cpu=True).prepare(torch.utils.data.DataLoader(_data(), batch_size=2))
    batches = iter(loader)
    next(batches)
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        with CheckpointManager(tmp_path / "ckpt", every=1, async_save=False) as ckpt:
            ckpt.maybe_save(0, data=loader)
    del batches
    assert "already in a pass when it was first given to the checkpoint manager" in caplog.text
    assert "Give the loader to restore() (or save) before iterating it" in caplog.text


@requires("accelerate")
def test_accelerate_loader_that_dispatches_batches_is_refused_naming_the_setting(tmp_path):
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(dispatch_batches=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(torch.utils.data.DataLoader(_data(), batch_size=2))
    with CheckpointManager(tmp_path / "ckpt", every=100, async_save=False) as ckpt:
        with pytest.raises(CheckpointError) as caught:
            ckpt.maybe_save(1, data=loader)
    message = str(caught.value)
    assert message.startswith("data=DataLoaderDispatcher: accelerate's loader that dispatches")
    assert "DataLoaderConfiguration(dispatch_batches=False)" in message


@requires("accelerate")
def test_accelerate_optimizer_under_accumulation_is_refused_without_its_accelerator(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    try:
        net = _net()
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        with CheckpointManager(tmp_path / "ckpt", every=100, async_save=False) as ckpt:
            with pytest.raises(CheckpointError) as caught:
                ckpt.maybe_save(1, model=model, optimizer=opt)
            ckpt.maybe_save(1, model=model, optimizer=opt, accelerator=accelerator)
    finally:
        accelerator.gradient_accumulation_steps = 1  # accelerate's state is one per process
    message = str(caught.value)
    assert message.startswith("optimizer=AcceleratedOptimizer steps every 2 micro-batches")
    assert "pass it too (accelerator=accelerator)" in message


@requires("accelerate")
def test_an_accelerator_between_two_accumulated_steps_gets_its_count_and_gradients_back(
    tmp_path,
):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    try:
        torch.manual_seed(0)
        net = _net()
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in range(4):  # one optimizer step, then one micro-batch towards the next
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.randn(2, 3)).sum())
                opt.step()
                opt.zero_grad()
        pending = [p.grad.clone() for p in net.parameters()]
        with CheckpointManager(tmp_path / "ckpt", every=4, async_save=False) as ckpt:
            ckpt.maybe_save(4, model=model, optimizer=opt, accelerator=accelerator)
        accelerator.step = 0  # as a fresh process has them
        net.zero_grad(set_to_none=True)
        with CheckpointManager(tmp_path / "ckpt", every=4, async_save=False) as ckpt:
            assert ckpt.restore(model=model, optimizer=opt, accelerator=accelerator) == 5
        assert accelerator.step == 4
        assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), pending, strict=True))
    finally:
        accelerator.gradient_accumulation_steps = 1
