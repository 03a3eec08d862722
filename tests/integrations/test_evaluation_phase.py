"""The trainers' callbacks mark evaluation as a named phase by themselves: a rank's progress
reports say ``evaluate`` while HF's ``Trainer`` or Lightning's runs its evaluation inside
training, so the kernel's hang watch gives it the long bound instead of calling it a hang."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from nbtools import events

pytestmark = pytest.mark.slow

_HF = """
    import time
    import torch
    from transformers import Trainer, TrainingArguments
    from nbtools._internal import hooks
    from nbtools.integrations.transformers import NbtoolsCheckpoint
    hooks.rank_started()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels):
            if not self.training:
                time.sleep(0.5)             # a slow evaluation batch
            return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}

    data = [{"x": torch.randn(4), "labels": torch.randn(())}] * 8
    args = TrainingArguments(
        output_dir=OUT + "/hf", max_steps=2, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )
    trainer = Trainer(model=Model(), args=args, train_dataset=data, eval_dataset=data,
                      callbacks=[NbtoolsCheckpoint(OUT + "/ckpt", every=100)])
    trainer.train()
    time.sleep(1.5)                     # a report after the evaluation ended
"""

_LIGHTNING = """
    import time
    import torch
    import lightning.pytorch as pl
    from nbtools._internal import hooks
    from nbtools.integrations.lightning import NbtoolsCheckpoint
    hooks.rank_started()

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            x, y = batch
            return (self.lin(x).squeeze(-1) - y).pow(2).mean()

        def validation_step(self, batch, index):
            time.sleep(0.5)                 # a slow evaluation batch

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        val_check_interval=2, callbacks=[NbtoolsCheckpoint(OUT + "/ckpt", every=100)],
    )
    trainer.fit(Model(), loader, loader)
    time.sleep(1.5)                     # a report after the evaluation ended
"""


def _phases(code: str, tmp_path) -> list[str | None]:
    bus = events.Bus()
    seen: list[events.Event] = []
    bus.subscribe(seen.extend)
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="0")
        script = f"OUT = {str(tmp_path)!r}\n" + textwrap.dedent(code)
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
        collector.drain()
    return [e.fields.get("phase") for e in seen if e.kind == "progress"]


@pytest.mark.parametrize("stack", ["hf", "lightning"])
def test_an_evaluation_inside_training_is_reported_as_a_phase_that_ends(stack, tmp_path):
    needs = "transformers" if stack == "hf" else "lightning"
    if importlib.util.find_spec(needs) is None:  # not imported here: the script imports it
        pytest.skip(f"{needs} is not installed")
    phases = _phases(_HF if stack == "hf" else _LIGHTNING, tmp_path)
    assert "evaluate" in phases, phases
    assert phases[-1] is None, phases  # closed once the evaluation ended
