"""A Trainer inside ``@distributed`` reports its steps to the kernel with no code of the user's.

HF's ``Trainer`` runs in a real kernel on 2 CPU ranks; the model is a cell's
class. Every rank's steps reach the kernel as ``progress`` events, the reports
that hang and straggler detection read.

The tests share one kernel, as cells of one notebook do: each starts with the names of a fresh
kernel only (those of earlier tests' cells deleted, checked) and an empty event log, so it sees
only its own launch's reports.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel, requires

pytestmark = pytest.mark.slow


_NAMES = "sorted(n for n in dir() if not n.startswith('_'))"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel, and the names its namespace holds before any cell ran."""
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        yield nb, nb.eval(_NAMES)


@pytest.fixture
def nb(kernel):
    """The module's kernel with no name of an earlier test's cells and no event logged."""
    nb, fresh = kernel
    left = [name for name in nb.eval(_NAMES) if name not in fresh]
    if left:
        nb.run(f"del {', '.join(left)}")
    assert nb.eval(_NAMES) == fresh
    nb.run("from nbtools import events\nevents.bus().clear()\ndel events")
    return nb


@requires("transformers", "accelerate")
def test_an_hf_trainer_on_two_ranks_reports_every_step_to_the_kernel(nb, tmp_path):
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


@requires("lightning")
def test_a_lightning_trainer_on_two_ranks_reports_every_step_to_the_kernel(nb):
    nb.run(
        textwrap.dedent("""\
        import torch
        import lightning.pytorch as pl
        from nbtools import distributed, events


        class Model(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)

            def training_step(self, batch, index):
                return self.lin(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
    """)
    )
    nb.run(
        textwrap.dedent("""\
        @distributed(processes=2, output="rank0")
        def fit():
            data = torch.utils.data.TensorDataset(torch.randn(28, 4))
            pl.Trainer(
                max_steps=7, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            ).fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))

        fit.distributed()
    """)
    )
    reports = nb.eval(
        "sorted({(e.rank, e.step, e.fields['steps']) for e in events.log(kinds=['progress'])})"
    )
    last = {rank: (step, steps) for rank, step, steps in reports}
    assert last == {0: (7, 7), 1: (7, 7)}, reports


def test_a_loop_written_in_a_cell_over_the_loader_reports_its_batches(nb):
    nb.run(
        textwrap.dedent("""\
        import torch
        from nbtools import distributed, events
        from nbtools.data import DataLoader


        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 24

            def __getitem__(self, i):
                return torch.tensor([float(i * i)])
    """)
    )
    nb.run(
        textwrap.dedent("""\
        @distributed(processes=2, output="rank0")
        def train():
            net = torch.nn.Linear(1, 1)
            opt = torch.optim.SGD(net.parameters(), lr=1e-4)
            for batch in DataLoader(Squares(), batch_size=4):  # no call to events
                opt.zero_grad()
                net(batch).mean().backward()
                opt.step()

        train.distributed()
    """)
    )
    reports = nb.eval(
        "sorted({(e.rank, e.fields['steps']) for e in events.log(kinds=['progress'])})"
    )
    last = dict(reports)  # each rank's latest count
    assert last == {0: 6, 1: 6}, reports
