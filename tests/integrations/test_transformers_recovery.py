"""HF ``Trainer`` with ``NbtoolsCheckpoint`` in a real kernel: a rank SIGKILLed mid-epoch,
the group restarted by ``@distributed(max_restarts=1)``, resumed by the callback alone.

The model (with dropout, so the RNG counts), the dataset and the callbacks are cells'
classes. An uninterrupted run over a fresh root is the reference: the recovered run
must end with its weights bit for bit, train again at most ``memory_every`` steps, and
have seen every sample once per epoch, in the same batches.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _history import effective, per_epoch
from _user_code_nb import NotebookKernel, requires

pytestmark = [pytest.mark.slow, pytest.mark.kernel, requires("transformers", "accelerate")]

SAMPLES, WORLD, BATCH, EPOCHS = 40, 2, 2, 3
PER_EPOCH = SAMPLES // (WORLD * BATCH)  # 10 steps
MEMORY_EVERY, EVERY, KILL_AT = 3, 7, 14

CELLS = (
    """\
    import json, os, signal
    import torch
    from nbtools import distributed, runtime


    class Model(torch.nn.Module):
        def __init__(self, log_dir):
            super().__init__()
            self.log_dir = log_dir
            self.lin = torch.nn.Linear(4, 8)
            self.drop = torch.nn.Dropout(0.3)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x, labels, idx):
            record = {"attempt": runtime.get_restart_count(), "ids": idx.tolist()}
            with open(f"{self.log_dir}/rank{runtime.get_rank()}.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\\n")
            y = self.out(self.drop(torch.relu(self.lin(x)))).squeeze(-1)
            return {"loss": ((y - labels) ** 2).mean()}


    class Samples(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}
    """,
    """\
    from transformers import TrainerCallback


    class KillRank1(TrainerCallback):
        def __init__(self, at):
            self.at = at

        def on_step_end(self, args, state, control, **kwargs):
            first = runtime.get_restart_count() == 0
            if self.at and first and runtime.get_rank() == 1 and state.global_step == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
    """,
    """\
    @distributed(processes=2, max_restarts=1, output="rank0")
    def fit(root, log_dir, kill_at, out_dir):
        from transformers import Trainer, TrainingArguments
        from nbtools.integrations.transformers import NbtoolsCheckpoint

        os.makedirs(log_dir, exist_ok=True)
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=out_dir, num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
            learning_rate=0.05, lr_scheduler_type="linear", report_to=[], use_cpu=True,
            save_strategy="no", logging_steps=4, disable_tqdm=True,
        )
        ckpt = NbtoolsCheckpoint(root, every=EVERY, memory_every=MEMORY_EVERY)
        trainer = Trainer(
            model=Model(log_dir), args=args, train_dataset=Samples(SAMPLES),
            callbacks=[ckpt, KillRank1(kill_at)],
        )
        trainer.train()  # no resume_from_checkpoint, on every attempt
        return {
            "restart": runtime.get_restart_count(),
            "restored_step": ckpt.restored_step,
            "tier": ckpt.restored_tier,
            "global_step": trainer.state.global_step,
            "epoch": trainer.state.epoch,
            "weights": {k: v.tolist() for k, v in trainer.model.state_dict().items()},
        }
    """,
)


def _fit(nb: NotebookKernel, tmp_path, name: str, kill_at: int) -> tuple[list[dict], str]:
    call = (
        f"results = fit.distributed({str(tmp_path / name / 'ckpt')!r}, "
        f"{str(tmp_path / name / 'log')!r}, {kill_at}, {str(tmp_path / name / 'out')!r})"
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
    assert [r["global_step"] for r in reference + recovered] == [steps] * 4

    # Restarted once, every rank from its memory snapshot, said so in the cell's output.
    restored = recovered[0]["restored_step"]
    assert [(r["restart"], r["tier"]) for r in recovered] == [(1, "memory")] * 2
    assert {r["restored_step"] for r in recovered} == {restored}
    assert restored % MEMORY_EVERY == 0 and KILL_AT - MEMORY_EVERY <= restored <= KILL_AT
    assert f"resumed after step {restored} from memory" in output, output

    # Bit-identical final weights, and they moved.
    for ours, theirs in zip(recovered, reference, strict=True):
        assert ours["weights"] == theirs["weights"]
    assert recovered[0]["weights"] == recovered[1]["weights"]

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
