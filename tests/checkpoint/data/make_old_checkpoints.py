"""Write the checkpoints of ``torch<version>/`` with the oldest torch nbtools supports.

Run with that torch (in its own virtual environment, nbtools on PYTHONPATH)::

    PYTHONPATH=. /path/to/venv/bin/python tests/checkpoint/data/make_old_checkpoints.py

It writes ``torch<major.minor>/manager`` (a ``CheckpointManager`` checkpoint of
step 3: a model, its SGD optimizer with momentum, and ``extra``) and
``torch<major.minor>/dcp`` (PyTorch's own ``FileSystemWriter``, with
``expected_state()``). ``test_torch_versions.py`` loads both with the torch
under test.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model() -> torch.nn.Linear:
    """The model saved (deterministic weights)."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
        model.bias.copy_(torch.tensor([0.5, -0.5, 1.5]))
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer saved, after one step with a fixed input (so it has momentum)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def expected_state() -> dict:
    """What ``dcp/`` holds."""
    return {"w": torch.arange(6, dtype=torch.float64).reshape(2, 3), "step": 7, "name": "old"}


def main() -> None:
    from nbtools.checkpoint import CheckpointManager

    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    out = os.path.join(HERE, f"torch{version}")
    shutil.rmtree(out, ignore_errors=True)
    model = make_model()
    opt = make_optimizer(model)
    with CheckpointManager(os.path.join(out, "manager"), async_save=False) as ckpt:
        ckpt.save(3, model=model, optimizer=opt, extra={"written_by": str(torch.__version__)})
    writer = dcp.FileSystemWriter(os.path.join(out, "dcp"))
    dcp.save(expected_state(), storage_writer=writer, no_dist=True)
    sys.stdout.write(f"wrote {out}\n")


if __name__ == "__main__":
    main()
