"""MLflow as its documentation advises, inside ``@distributed(processes=2)``, from a real kernel.

Hugging Face with ``report_to="mlflow"`` and ``MLFLOW_EXPERIMENT_NAME``: the
training is one run with its run name, on a sqlite store that did not exist
before the launch. The data is defined in notebook cells. Lightning with
``mlflow.pytorch.autolog()`` and a DDP ``Trainer``, and resuming a run by id
from every rank, run in notebook 09, whose cells check their runs.
"""

from __future__ import annotations

import os
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
        nb.run(
            textwrap.dedent(f"""\
            import os
            os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
            os.environ["MLFLOW_TRACKING_URI"] = {store!r}       # a new store: no file yet
            os.environ["MLFLOW_EXPERIMENT_NAME"] = {EXPERIMENT!r}  # an absolute path, as advised
            import torch
            from torch.utils.data import Dataset
            from nbtools import distributed
        """)
        )
        yield nb


def _client(store):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"experiment {EXPERIMENT} was not created"
    return client, client.search_runs([experiment.experiment_id])


@requires("transformers")
def test_hf_report_to_mlflow_gives_one_run_with_the_run_name(kernel, store, tmp_path):
    kernel.run(
        textwrap.dedent("""\
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
    """)
    )
    assert not os.path.exists(store.removeprefix("sqlite:///")), "a new store"
    output = kernel.run(f"hf_fit.distributed({str(tmp_path / 'hf')!r})")
    client, runs = _client(store)
    assert [r.info.run_name for r in runs] == ["gpt2-tiny-lr3e5"]
    assert len(client.get_metric_history(runs[0].info.run_id, "loss")) == 3
    assert NOTICE not in output, "Hugging Face starts runs on rank 0 only: nothing to say"
