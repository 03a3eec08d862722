"""accelerate in a real kernel: what ``accelerator.prepare()`` returns (model, optimizer,
scheduler and a plain shuffling ``DataLoader``) goes to ``CheckpointManager`` as it is, a
rank is SIGKILLed mid-epoch, and the group restarted by ``@distributed(max_restarts=1)``
resumes by the manager alone.

The network (with dropout, so the RNG counts), the dataset and the loop are cells'
code; accelerate wraps the model in DDP, the optimizer and scheduler in its own
classes, and shards the loader's batches between the ranks from a generator it
synchronises as each pass starts. An uninterrupted run over a
fresh root is the reference: the recovered run must restore from memory, end with
its weights bit for bit, and have seen every sample once per epoch, in the same
batches.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _history import check_same_batches
from _user_code_nb import NotebookKernel, requires

pytestmark = [pytest.mark.slow, pytest.mark.kernel, requires("accelerate")]

SAMPLES, WORLD, BATCH, EPOCHS = 40, 2, 2, 3
PER_EPOCH = SAMPLES // (WORLD * BATCH)  # 10 steps
MEMORY_EVERY, EVERY, KILL_AT = 3, 10, 14

CELLS = (
    """\
    import json, os, signal
    import torch
    from accelerate import Accelerator
    from nbtools import distributed, runtime
    from nbtools.checkpoint import CheckpointManager


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 8)
            self.drop = torch.nn.Dropout(0.3)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.out(self.drop(torch.relu(self.lin(x)))).squeeze(-1)


    def dataset():
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, generator=g)
        return torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES))
    """,
    """\
    @distributed(processes=2, max_restarts=1, output="rank0")
    def train(root, log_dir, kill_at):
        os.makedirs(log_dir, exist_ok=True)
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.7)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
        model, opt, sched, loader = accelerator.prepare(net, opt, sched, loader)
        ckpt = CheckpointManager(root, every=EVERY, memory_every=MEMORY_EVERY)
        start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, data=loader)
        print(f"starting at step {start}, restored from {ckpt.restored_tier}")
        step = start
        while step < EPOCHS * PER_EPOCH:
            for x, y, idx in loader:
                record = {"attempt": runtime.get_restart_count(), "ids": idx.tolist()}
                with open(f"{log_dir}/rank{runtime.get_rank()}.jsonl", "a") as fh:
                    fh.write(json.dumps(record) + "\\n")
                accelerator.backward(((model(x) - y) ** 2).mean())
                opt.step()
                opt.zero_grad()
                sched.step()
                ckpt.maybe_save(step, model=model, optimizer=opt, scheduler=sched, data=loader)
                first = runtime.get_restart_count() == 0
                if kill_at and first and runtime.get_rank() == 1 and step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                step += 1
        ckpt.close()
        return {
            "restart": runtime.get_restart_count(),
            "start": start,
            "tier": ckpt.restored_tier,
            "step": step,
            "weights": {k: v.tolist() for k, v in net.state_dict().items()},
        }
    """,
)


def _train(nb: NotebookKernel, tmp_path, name: str, kill_at: int) -> tuple[list[dict], str]:
    call = (
        f"results = train.distributed({str(tmp_path / name / 'ckpt')!r}, "
        f"{str(tmp_path / name / 'log')!r}, {kill_at})"
    )
    output = nb.run(call)
    return json.loads(str(nb.eval("json.dumps(results)"))), output


def test_a_killed_rank_resumes_from_memory_and_ends_like_an_uninterrupted_run(tmp_path):
    with NotebookKernel(tmp_path) as nb:
        nb.run(
            f"SAMPLES, BATCH, EPOCHS, PER_EPOCH, EVERY, MEMORY_EVERY = "
            f"{SAMPLES}, {BATCH}, {EPOCHS}, {PER_EPOCH}, {EVERY}, {MEMORY_EVERY}"
        )
        for cell in CELLS:
            nb.run(textwrap.dedent(cell))
        reference, fresh_output = _train(nb, tmp_path, "reference", kill_at=0)
        recovered, output = _train(nb, tmp_path, "recovered", kill_at=KILL_AT)

    steps = EPOCHS * PER_EPOCH
    assert [(r["restart"], r["start"], r["tier"]) for r in reference] == [(0, 0, None)] * 2
    assert "starting at step 0, restored from None" in fresh_output
    assert [r["step"] for r in reference + recovered] == [steps] * 4

    # Restarted once, every rank from its memory snapshot, said so in the cell's output.
    start = recovered[0]["start"]
    assert [(r["restart"], r["tier"]) for r in recovered] == [(1, "memory")] * 2
    assert {r["start"] for r in recovered} == {start}
    assert start % MEMORY_EVERY == 1 and KILL_AT - MEMORY_EVERY < start <= KILL_AT + 1
    assert f"starting at step {start}, restored from memory" in output, output

    # Every sample once per epoch, in the batches of the uninterrupted run.
    check_same_batches(tmp_path, WORLD, start, PER_EPOCH, EPOCHS)

    # Bit-identical final weights on both ranks.
    for ours, theirs in zip(recovered, reference, strict=True):
        assert ours["weights"] == theirs["weights"]
