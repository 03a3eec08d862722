"""Run by test_hangs: an HF or Lightning Trainer whose steps the installed hook counts.

``install()`` runs before the library is imported, as it does at the start of a rank.
"""

from __future__ import annotations

import sys
import tempfile

import torch

from nbtools.events import _progress
from nbtools.launch._rank._trainer_hooks import install


def hf() -> None:
    from transformers import Trainer, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels):
            return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}

    data = [{"x": torch.randn(4), "labels": torch.tensor(1.0)} for _ in range(16)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=5,
            per_device_train_batch_size=2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        Trainer(model=Model(), args=args, train_dataset=data).train()


def lightning() -> None:
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(14, 4))
    pl.Trainer(
        max_steps=7,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))


if __name__ == "__main__":
    install()
    {"hf": hf, "pl": lightning}[sys.argv[1]]()
    step, count, _ = _progress.progress_so_far()
    print("PROGRESS", step, count)
