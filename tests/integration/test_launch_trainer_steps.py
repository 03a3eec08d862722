"""A Trainer inside ``@distributed`` reports its steps to the kernel with no code of the user's.

HF's ``Trainer`` runs in a real kernel on 2 CPU ranks; the model is a cell's
class. Every rank's steps reach the kernel as ``progress`` events, the reports
that hang and straggler detection read.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel, requires

pytestmark = [pytest.mark.slow, requires("transformers", "accelerate")]


def test_an_hf_trainer_on_two_ranks_reports_every_step_to_the_kernel(tmp_path):
    with NotebookKernel(tmp_path) as nb:
        nb.run(
            textwrap.dedent("""\
            import torch
            from nbtools import distributed, events


            class Model(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = torch.nn.Linear(4, 1)

                def forward(self, x, labels):
                    return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}
        """)
        )
        nb.run(
            textwrap.dedent(f"""\
            @distributed(processes=2, output="rank0")
            def fit():
                from transformers import Trainer, TrainingArguments

                data = [{{"x": torch.randn(4), "labels": torch.tensor(1.0)}} for _ in range(32)]
                args = TrainingArguments(
                    output_dir={str(tmp_path / "out")!r}, max_steps=5,
                    per_device_train_batch_size=2, report_to=[], use_cpu=True,
                    save_strategy="no", logging_strategy="no", disable_tqdm=True,
                )
                Trainer(model=Model(), args=args, train_dataset=data).train()

            fit.distributed()
        """)
        )
        reports = nb.eval(
            "sorted({(e.rank, e.step, e.fields['steps']) for e in events.log(kinds=['progress'])})"
        )
    last = {rank: (step, steps) for rank, step, steps in reports}  # each rank's latest report
    assert last == {0: (5, 5), 1: (5, 5)}, reports
