"""Third-party training code, unchanged, inside ``@distributed(processes=2)``.

Hugging Face ``Trainer``, plain ``accelerate.Accelerator()`` and Lightning
Fabric, each fed by a dataset class defined in a notebook cell of a real
kernel and loaded by worker processes inside the ranks. Models are built from
configs and data is made in the cell: nothing is downloaded.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel, requires

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        nb.run(
            textwrap.dedent("""\
            import os
            import torch
            from torch.utils.data import Dataset
            from nbtools import distributed


            class Numbers(Dataset):             # defined in the notebook: lives in __main__
                def __len__(self):
                    return 64

                def __getitem__(self, i):
                    return torch.tensor([float(i)]), torch.tensor([2.0 * i])
        """)
        )
        yield nb


def _check_half_each(results, batches=8, batch_size=4):
    """Each rank got its own half of the 64 samples."""
    halves = [r["ids"] for r in results]
    assert [len(h) for h in halves] == [batches * batch_size] * 2
    assert sorted(halves[0] + halves[1]) == list(range(64))
    assert results[0]["weight"] == results[1]["weight"], "gradients were synchronised"


@requires("transformers")
def test_hf_trainer_on_two_ranks_with_cell_dataset_workers_and_resume(kernel, tmp_path):
    kernel.run(
        textwrap.dedent("""\
        class TokenBlocks(Dataset):             # integer token ids: no tokenizer, no download
            def __init__(self, n, length=16, vocab=128):
                self.blocks = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

            def __len__(self):
                return len(self.blocks)

            def __getitem__(self, i):
                return {"input_ids": self.blocks[i], "labels": self.blocks[i].clone()}


        @distributed(processes=2)
        def fit(out_dir, max_steps, resume=False):
            import torch.distributed as dist
            from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                                      TrainingArguments)

            steps = []

            class Steps(TrainerCallback):
                def on_step_end(self, args, state, control, **kwargs):
                    steps.append(state.global_step)

            torch.manual_seed(0)
            config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=16,
                                bos_token_id=0, eos_token_id=0)
            args = TrainingArguments(
                output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=4,
                save_strategy="steps", save_steps=2, logging_steps=1, dataloader_num_workers=2,
                report_to="none", disable_tqdm=True, seed=0,
            )
            trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=TokenBlocks(64),
                              callbacks=[Steps()])
            trainer.train(resume_from_checkpoint=True if resume else None)
            return dict(rank=dist.get_rank(), world=dist.get_world_size(), args_world=args.world_size,
                        processes=trainer.accelerator.num_processes, steps=steps,
                        global_step=trainer.state.global_step)
    """)
    )
    out = str(tmp_path / "gpt2")
    first = kernel.eval(f"fit.distributed({out!r}, max_steps=4)")
    ckpt4 = tmp_path / "gpt2" / "checkpoint-4"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in ckpt4.iterdir()}, (
        "the Trainer saw two processes"
    )
    resumed = kernel.eval(f"fit.distributed({out!r}, max_steps=6, resume=True)")

    for results in (first, resumed):
        assert [r["rank"] for r in results] == [0, 1]
        assert all(r["world"] == r["args_world"] == r["processes"] == 2 for r in results)
    assert all(r["steps"] == [1, 2, 3, 4] for r in first)
    assert all(r["steps"] == [5, 6] and r["global_step"] == 6 for r in resumed), (
        "the second run continued from checkpoint-4"
    )
    assert (tmp_path / "gpt2" / "checkpoint-6").is_dir()


@requires("accelerate")
def test_plain_accelerator_is_distributed_over_the_ranks(kernel):
    kernel.run(
        textwrap.dedent("""\
        @distributed(processes=2)
        def accelerate_fit():
            from accelerate import Accelerator

            accelerator = Accelerator()
            torch.manual_seed(0)
            model = torch.nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            loader = torch.utils.data.DataLoader(Numbers(), batch_size=4, num_workers=2)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            ids = []
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                ids += x.flatten().int().tolist()
            return dict(type=accelerator.distributed_type.value, processes=accelerator.num_processes,
                        index=accelerator.process_index, ids=ids,
                        weight=accelerator.unwrap_model(model).weight.item())
    """)
    )
    results = kernel.eval("accelerate_fit.distributed()")

    assert [(r["type"], r["processes"], r["index"]) for r in results] == [
        ("MULTI_CPU", 2, 0),
        ("MULTI_CPU", 2, 1),
    ]
    _check_half_each(results)


@requires("lightning")
def test_lightning_fabric_ddp_attaches_to_the_ranks(kernel):
    kernel.run(
        textwrap.dedent("""\
        @distributed(processes=2)
        def fabric_fit():
            import torch.distributed as dist
            from lightning.fabric import Fabric

            fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
            fabric.launch()
            torch.manual_seed(0)
            model = torch.nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            model, optimizer = fabric.setup(model, optimizer)
            loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(Numbers(), batch_size=4, num_workers=2))
            ids = []
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                ids += x.flatten().int().tolist()
            ranks = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
            return dict(world=fabric.world_size, rank=fabric.global_rank, group=dist.get_world_size(),
                        rank_sum=ranks.item(), ids=ids, weight=model.weight.item())
    """)
    )
    results = kernel.eval("fabric_fit.distributed()")

    assert [(r["world"], r["group"], r["rank"]) for r in results] == [(2, 2, 0), (2, 2, 1)]
    assert all(r["rank_sum"] == 1.0 for r in results)
    _check_half_each(results)


def _wandb_services() -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "wandb-core" in " ".join(proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found


@requires("wandb")
def test_wandb_offline_in_ranks_ends_without_a_warning_and_leaves_nothing_running(kernel, tmp_path):
    import pathlib
    import tempfile
    import time

    before = set(_wandb_services())
    text = kernel.run(
        textwrap.dedent(f"""\
        @distributed(processes=2)
        def tracked():
            import torch.distributed as dist
            import wandb

            rank = dist.get_rank()
            run = wandb.init(mode="offline", dir={str(tmp_path)!r}, project="nbtools", name=f"rank{{rank}}")
            for i in range(3):
                run.log({{"loss": 1.0 / (i + 1)}})
            run.finish()
            print("finished", rank)

        tracked.distributed()
    """)
    )
    assert "[rank 0] finished 0" in text and "[rank 1] finished 1" in text, text
    assert "left a process running" not in text and "End what a rank starts" not in text, text
    # Each exit handler ran once, as at interpreter exit (W&B's own shuts OpenTelemetry's down
    # and unregisters it), and the ranks ended as they returned: no error file is left.
    assert "can only be called once" not in text and "exited with code" not in text, text
    assert not list(pathlib.Path(tempfile.gettempdir()).glob("pytorch-errorfile-*")), text
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 2  # both runs were recorded
    deadline = time.monotonic() + 30
    while set(_wandb_services()) - before and time.monotonic() < deadline:
        time.sleep(0.2)  # the services were stopped with the ranks; let the OS reap them
    assert not set(_wandb_services()) - before
