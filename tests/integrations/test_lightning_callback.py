"""``NbtoolsCheckpoint`` for Lightning's ``Trainer`` in one process: a second ``fit()`` over
the same root continues after the last step saved (mid-epoch, a shuffling loader with no
generator of its own), to the weights of one whole run, and an explicit ``ckpt_path``
wins."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from nbtools.integrations.lightning import NbtoolsCheckpoint

pytestmark = pytest.mark.slow


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.batches = 0

    def training_step(self, batch, index):
        self.batches += 1
        x, y = batch
        return (self.lin(x).squeeze(-1) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _fit(tmp_path, max_steps: int, ckpt: NbtoolsCheckpoint, ckpt_path=None) -> _Model:
    torch.manual_seed(0)
    model = _Model()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    )
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, ModelCheckpoint(tmp_path / "pl", every_n_train_steps=2, save_top_k=-1)],
    )
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return model


def test_fit_again_continues_after_the_last_step_and_an_explicit_ckpt_path_wins(tmp_path):
    root = tmp_path / "ckpt"
    first = _fit(tmp_path, 17, NbtoolsCheckpoint(root, every=8))  # mid-epoch 2 of 12 batches
    assert first.batches == 17
    assert sorted(p.name for p in root.glob("step_*")) == ["step_16", "step_17", "step_8"]

    ckpt = NbtoolsCheckpoint(root, every=8)
    second = _fit(tmp_path, 30, ckpt)  # no ckpt_path: the volume's step 17
    assert (ckpt.restored_step, ckpt.restored_tier) == (17, "volume")
    assert second.batches == 13
    fresh = NbtoolsCheckpoint(tmp_path / "fresh", every=8)
    whole = _fit(tmp_path / "whole", 30, fresh)  # a fresh root: step 0, no error
    assert fresh.restored_step is None and whole.batches == 30
    assert torch.equal(second.lin.weight, whole.lin.weight)

    ckpt = NbtoolsCheckpoint(root, every=8)
    third = _fit(tmp_path, 30, ckpt, ckpt_path=tmp_path / "pl" / "epoch=0-step=2.ckpt")
    assert ckpt.restored_step is None  # Lightning loaded its own checkpoint
    assert third.batches == 28
