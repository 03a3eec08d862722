"""A training loop of the user's own under a library that wraps its objects (Fabric,
accelerate), run in a real kernel: cells define the network (with dropout, so the RNG
counts) and the dataset; the loop hands the library's objects to ``CheckpointManager``
as they are. Rank 1 is SIGKILLed mid-epoch and ``@distributed(max_restarts=1)``
restarts the group, which resumes by the manager alone.

An uninterrupted run over a fresh root is the reference: the recovered run must restore
from memory, say so in the cell's output, have seen every sample once per epoch in the
same batches, and end with the reference's weights bit for bit.
"""

from __future__ import annotations

import json
import textwrap

from _history import check_same_batches
from _user_code_nb import NotebookKernel

__all__ = ["check_killed_rank_resumes"]

SAMPLES, WORLD, BATCH, EPOCHS = 40, 2, 2, 3
PER_EPOCH = SAMPLES // (WORLD * BATCH)  # 10 steps
MEMORY_EVERY, EVERY, KILL_AT = 3, 10, 14

_CELL = """\
import contextlib, json, os, signal
import torch
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
"""

_TRAIN = """\
@distributed(processes=2, max_restarts=1, output="rank0")
def train(root, log_dir, kill_at):
    os.makedirs(log_dir, exist_ok=True)
{setup}
    ckpt = CheckpointManager(root, every=EVERY, memory_every=MEMORY_EVERY)
    start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, data=loader{more})
    print(f"starting at step {{start}}, restored from {{ckpt.restored_tier}}")
    step = start
    while step < EPOCHS * PER_EPOCH:
        for x, y, idx in loader:
            record = {{"attempt": runtime.get_restart_count(), "ids": idx.tolist()}}
            with open(f"{{log_dir}}/rank{{runtime.get_rank()}}.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\\n")
            with {context}:
                {backward}(((model(x) - y) ** 2).mean())
                opt.step()
                opt.zero_grad()
                sched.step()
            ckpt.maybe_save(step, model=model, optimizer=opt, scheduler=sched, data=loader{more})
            if kill_at and runtime.get_restart_count() == 0 and step == kill_at:
                ckpt.wait()  # the last snapshot is complete on every rank when the crash comes
                torch.distributed.barrier()
                if runtime.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            step += 1
    ckpt.close()
    return {{
        "restart": runtime.get_restart_count(),
        "start": start,
        "tier": ckpt.restored_tier,
        "step": step,
        "weights": {{k: v.tolist() for k, v in net.state_dict().items()}},
    }}
"""


def _train(nb: NotebookKernel, tmp_path, name: str, kill_at: int) -> tuple[list[dict], str]:
    call = (
        f"results = train.distributed({str(tmp_path / name / 'ckpt')!r}, "
        f"{str(tmp_path / name / 'log')!r}, {kill_at})"
    )
    output = nb.run(call)
    return json.loads(str(nb.eval("json.dumps(results)"))), output


def check_killed_rank_resumes(
    tmp_path,
    setup: str,
    backward: str,
    context: str = "contextlib.nullcontext()",
    more: str = "",
) -> None:
    """Run the loop twice in one kernel (uninterrupted, then with rank 1 killed) and check
    the recovery. ``setup`` is the function's code (imports included) that makes ``net``
    and the library's ``model``, ``opt``, ``sched`` and ``loader``; ``backward`` the call
    that back-propagates a loss (``loss.backward`` is not enough under the libraries);
    ``context`` what each batch's step runs in (``accelerator.accumulate(model)``);
    ``more`` further objects for the manager (``accelerator=accelerator``)."""
    with NotebookKernel(tmp_path) as nb:
        nb.run(
            f"SAMPLES, BATCH, EPOCHS, PER_EPOCH, EVERY, MEMORY_EVERY = "
            f"{SAMPLES}, {BATCH}, {EPOCHS}, {PER_EPOCH}, {EVERY}, {MEMORY_EVERY}"
        )
        nb.run(_CELL)
        setup = textwrap.indent(textwrap.dedent(setup).strip("\n"), "    ")
        more = f", {more}" if more else ""
        nb.run(_TRAIN.format(setup=setup, backward=backward, context=context, more=more))
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
