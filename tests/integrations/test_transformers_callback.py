"""``NbtoolsCheckpoint`` for HF's ``Trainer`` in one process: a second ``train()`` over the
same root continues after the last step saved, with the Trainer's own ``save_steps``
checkpoints on beside it, and an explicit ``resume_from_checkpoint`` wins."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import Trainer, TrainingArguments

from nbtools.integrations.transformers import NbtoolsCheckpoint

pytestmark = pytest.mark.slow


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.forwards = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.forwards += 1
        return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}


def _trainer(tmp_path, max_steps: int, ckpt: NbtoolsCheckpoint) -> Trainer:
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)}] * 32
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        disable_tqdm=True,
        lr_scheduler_type="constant",  # the same schedule whatever max_steps is
    )
    torch.manual_seed(0)
    return Trainer(model=_Model(), args=args, train_dataset=data, callbacks=[ckpt])


def test_train_again_continues_after_the_last_step_and_an_explicit_resume_wins(tmp_path):
    root = tmp_path / "ckpt"
    first = _trainer(tmp_path, 6, NbtoolsCheckpoint(root, every=4))
    first.train()
    assert first.state.global_step == 6 and first.model.forwards == 6
    assert sorted(p.name for p in root.glob("step_*")) == ["step_4", "step_6"]

    ckpt = NbtoolsCheckpoint(root, every=4)
    second = _trainer(tmp_path, 10, ckpt)
    second.train()  # no resume_from_checkpoint: the volume's step 6
    assert (ckpt.restored_step, ckpt.restored_tier) == (6, "volume")
    assert second.state.global_step == 10 and second.model.forwards == 4
    fresh = NbtoolsCheckpoint(tmp_path / "fresh", every=4)
    whole = _trainer(tmp_path, 10, fresh)
    whole.train()  # a fresh root: step 0, no error
    assert fresh.restored_step is None and whole.model.forwards == 10
    assert torch.equal(second.model.lin.weight, whole.model.lin.weight)
    assert not torch.equal(_trainer(tmp_path, 1, fresh).model.lin.weight, whole.model.lin.weight)

    ckpt = NbtoolsCheckpoint(root, every=4)
    third = _trainer(tmp_path, 10, ckpt)
    third.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-2"))
    assert ckpt.restored_step is None  # the Trainer loaded its own checkpoint
    assert third.state.global_step == 10 and third.model.forwards == 8
