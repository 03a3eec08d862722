"""MLflow as its documentation advises, inside ``@distributed(processes=2)``, from a real kernel.

Lightning with ``mlflow.pytorch.autolog()`` and a DDP ``Trainer``, Hugging Face
with ``report_to="mlflow"``, ``MLFLOW_EXPERIMENT_NAME`` and resuming a run by
id: each training is one run, on a sqlite store that did not exist before the
first launch. The model and the data are defined in notebook cells.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel, requires

pytestmark = pytest.mark.slow

EXPERIMENT = "/Users/tester@example.com/ranks"
NOTICE = "rank 0 records the runs"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'new' / 'mlflow.db'}"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory, store):
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        nb.run(textwrap.dedent(f"""\
            import os
            os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
            os.environ["MLFLOW_TRACKING_URI"] = {store!r}       # a new store: no file yet
            os.environ["MLFLOW_EXPERIMENT_NAME"] = {EXPERIMENT!r}  # an absolute path, as advised
            import torch
            from torch.utils.data import Dataset
            from nbtools import distributed


            class Pairs(Dataset):                   # defined in the notebook: lives in __main__
                def __len__(self):
                    return 32

                def __getitem__(self, i):
                    return torch.tensor([float(i)]), torch.tensor([2.0 * i])
        """))
        yield nb


def _client(store):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"experiment {EXPERIMENT} was not created"
    return client, client.search_runs([experiment.experiment_id])


@requires("lightning")
def test_lightning_autolog_gives_one_run_per_fit_with_rank_zeros_metrics(kernel, store):
    kernel.run(textwrap.dedent("""\
        import lightning as L


        class Line(L.LightningModule):          # defined in the notebook, too
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(1, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.layer(x), y)
                self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
                self.log("lr_seen", 1e-4, on_step=False, on_epoch=True)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1e-4)


        @distributed(processes=2)
        def fit(run_id=None):
            import mlflow
            import torch.distributed as dist

            mlflow.pytorch.autolog(log_models=False)
            trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2,
                                logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
            loader = torch.utils.data.DataLoader(Pairs(), batch_size=4, num_workers=1)
            if run_id is None:
                trainer.fit(Line(), loader)
                active = None
            else:
                with mlflow.start_run(run_id=run_id) as run:   # resume, as the documentation says
                    trainer.fit(Line(), loader)
                    active = run.info.run_id
            return dict(rank=dist.get_rank(), active=active,
                        logged=sorted(trainer.callback_metrics))
    """))
    first_output = kernel.run("first = fit.distributed(); first")
    first = kernel.eval("first")
    client, runs = _client(store)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    assert first_output.count(NOTICE) == 1, "rank 0 says once what nbtools changes in other ranks"
    kernel.run("second = fit.distributed()")
    client, runs = _client(store)
    assert len(runs) == 2, "one run per fit, none from rank 1"
    logged = set(first[0]["logged"])
    assert {"train_loss_epoch", "lr_seen"} <= logged
    for run in runs:
        assert logged <= set(run.data.metrics), (run.info.run_name, run.data.metrics)
        assert len(client.get_metric_history(run.info.run_id, "train_loss_epoch")) == 2  # 2 epochs

    # Resume the first run by id from every rank: no new run, its history grows.
    resumed_id = min(runs, key=lambda r: r.info.start_time).info.run_id
    resumed = kernel.eval(f"fit.distributed(run_id={resumed_id!r})")
    assert [r["active"] for r in resumed] == [resumed_id, resumed_id]
    client, runs = _client(store)
    assert len(runs) == 2
    assert len(client.get_metric_history(resumed_id, "train_loss_epoch")) == 4


@requires("transformers")
def test_hf_report_to_mlflow_gives_one_run_with_the_run_name(kernel, store, tmp_path):
    kernel.run(textwrap.dedent("""\
        class Tokens(Dataset):                  # integer token ids: no tokenizer, no download
            def __len__(self):
                return 16

            def __getitem__(self, i):
                ids = torch.arange(8) + i % 4
                return {"input_ids": ids, "labels": ids.clone()}


        @distributed(processes=2)
        def hf_fit(out_dir):
            from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

            config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8,
                                bos_token_id=0, eos_token_id=0)
            args = TrainingArguments(output_dir=out_dir, report_to="mlflow",
                                     run_name="gpt2-tiny-lr3e5", logging_steps=1, max_steps=3,
                                     per_device_train_batch_size=2, save_strategy="no",
                                     disable_tqdm=True, learning_rate=3e-5)
            Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens()).train()
    """))
    _, before = _client(store)
    kernel.run(f"hf_fit.distributed({str(tmp_path / 'hf')!r})")
    client, runs = _client(store)
    new = [r for r in runs if r.info.run_id not in {b.info.run_id for b in before}]
    assert [r.info.run_name for r in new] == ["gpt2-tiny-lr3e5"]
    assert len(client.get_metric_history(new[0].info.run_id, "loss")) == 3
