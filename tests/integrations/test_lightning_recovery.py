"""Lightning's ``Trainer`` with ``NbtoolsCheckpoint`` in a real kernel: a rank SIGKILLed
mid-epoch, the group restarted by ``@distributed(max_restarts=1)``, resumed by the
callback alone.

The module (with dropout, so the RNG counts; AdamW and a StepLR), the datamodule and
the callbacks are cells' classes; Lightning builds the loaders and adds the
``DistributedSampler``. An uninterrupted run over a fresh root is the reference: the
recovered run must end with its weights bit for bit, train again at most
``memory_every`` steps, and have seen every sample once per epoch, in the same batches.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _history import effective, per_epoch
from _user_code_nb import NotebookKernel, requires

pytestmark = [pytest.mark.slow, pytest.mark.kernel, requires("lightning")]

SAMPLES, WORLD, BATCH, EPOCHS = 40, 2, 2, 3
PER_EPOCH = SAMPLES // (WORLD * BATCH)  # 10 steps
MEMORY_EVERY, EVERY, KILL_AT = 3, 7, 14

CELLS = (
    """\
    import json, os, signal
    import torch
    import lightning.pytorch as pl
    from nbtools import distributed, runtime


    class Model(pl.LightningModule):
        def __init__(self, log_dir):
            super().__init__()
            self.log_dir = log_dir
            self.lin = torch.nn.Linear(4, 8)
            self.drop = torch.nn.Dropout(0.3)
            self.out = torch.nn.Linear(8, 1)

        def training_step(self, batch, index):
            x, y, idx = batch
            record = {"attempt": runtime.get_restart_count(), "ids": idx.tolist()}
            with open(f"{self.log_dir}/rank{runtime.get_rank()}.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\\n")
            return ((self.out(self.drop(torch.relu(self.lin(x)))).squeeze(-1) - y) ** 2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.7)}


    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, generator=g)
            ds = torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES))
            return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)


    class KillRank1(pl.Callback):
        def __init__(self, at):
            self.at = at

        def on_train_batch_end(self, trainer, *args, **kwargs):
            first = runtime.get_restart_count() == 0
            if self.at and first and runtime.get_rank() == 1 and trainer.global_step == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
    """,
    """\
    @distributed(processes=2, max_restarts=1, output="rank0")
    def fit(root, log_dir, kill_at):
        from nbtools.integrations.lightning import NbtoolsCheckpoint

        os.makedirs(log_dir, exist_ok=True)
        torch.manual_seed(0)
        model = Model(log_dir)
        ckpt = NbtoolsCheckpoint(root, every=EVERY, memory_every=MEMORY_EVERY)
        trainer = pl.Trainer(
            max_epochs=EPOCHS, accelerator="cpu", devices=2, strategy="ddp", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ckpt, KillRank1(kill_at)],
        )
        trainer.fit(model, Data())  # no ckpt_path, on every attempt
        return {
            "restart": runtime.get_restart_count(),
            "restored_step": ckpt.restored_step,
            "tier": ckpt.restored_tier,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        }
    """,
)


def _fit(nb: NotebookKernel, tmp_path, name: str, kill_at: int) -> tuple[list[dict], str]:
    call = (
        f"results = fit.distributed({str(tmp_path / name / 'ckpt')!r}, "
        f"{str(tmp_path / name / 'log')!r}, {kill_at})"
    )
    output = nb.run(call)
    results = json.loads(str(nb.eval("json.dumps(results)")))
    return results, output


def test_a_killed_rank_resumes_from_memory_and_ends_like_an_uninterrupted_run(tmp_path):
    with NotebookKernel(tmp_path) as nb:
        nb.run(
            f"SAMPLES, BATCH, EPOCHS, EVERY, MEMORY_EVERY = "
            f"{SAMPLES}, {BATCH}, {EPOCHS}, {EVERY}, {MEMORY_EVERY}"
        )
        for cell in CELLS:
            nb.run(textwrap.dedent(cell))
        reference, fresh_output = _fit(nb, tmp_path, "reference", kill_at=0)
        recovered, output = _fit(nb, tmp_path, "recovered", kill_at=KILL_AT)

    # The fresh run started at 0, with nothing to restore and no error.
    assert [(r["restart"], r["restored_step"], r["tier"]) for r in reference] == [
        (0, None, None)
    ] * 2
    assert "resumed" not in fresh_output
    steps = EPOCHS * PER_EPOCH
    assert [(r["global_step"], r["epoch"]) for r in reference + recovered] == [(steps, EPOCHS)] * 4

    # Restarted once, every rank from its memory snapshot, said so in the cell's output.
    restored = recovered[0]["restored_step"]
    assert [(r["restart"], r["tier"]) for r in recovered] == [(1, "memory")] * 2
    assert {r["restored_step"] for r in recovered} == {restored}
    assert restored % MEMORY_EVERY == 0 and KILL_AT - MEMORY_EVERY <= restored <= KILL_AT
    assert f"resumed after step {restored} from memory" in output, output
    assert "not resumable" not in output  # the callback skips what was trained on

    # Bit-identical final weights on both ranks.
    for ours, theirs in zip(recovered, reference, strict=True):
        assert ours["weights"] == theirs["weights"]

    # Every sample once per epoch, in the batches of the uninterrupted run.
    for rank in range(WORLD):
        mine = effective(tmp_path / "recovered" / "log", rank, restored)
        assert mine == effective(tmp_path / "reference" / "log", rank, None)
        assert len(mine) == steps
    both = [
        a + b
        for a, b in zip(
            per_epoch(effective(tmp_path / "recovered" / "log", 0, restored), PER_EPOCH),
            per_epoch(effective(tmp_path / "recovered" / "log", 1, restored), PER_EPOCH),
            strict=True,
        )
    ]
    assert [sorted(ids) for ids in both] == [list(range(SAMPLES))] * EPOCHS
