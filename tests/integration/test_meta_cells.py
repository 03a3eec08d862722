"""A model class defined in a notebook cell, built on the meta device, through ``%%autoresume``.

A real kernel defines the class (it lives in the kernel's ``__main__``), builds it
under ``torch.device("meta")`` with its optimizer, and trains it in an
``%%autoresume`` cell that fails part way. Running the setup and the cell again
restores into a new meta-built model: the run ends on the weights of an
uninterrupted run of a CPU-built model from the same seed.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.slow

CLASS = """\
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 2)
        self.scale = torch.nn.Parameter(torch.empty(2))

    def reset_parameters(self):  # the owner of `scale` initialises it on a fresh start
        torch.nn.init.ones_(self.scale)

    def forward(self, x):
        return self.body(x) * self.scale


x = torch.linspace(-1, 1, 32).reshape(8, 4)
"""

SETUP = """\
torch.manual_seed(0)
with torch.device("meta"):
    model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
"""

TRAIN = """\
%%autoresume {root} --every 3 --state model,optimizer
for step in range(start_step, 10):
    if step == stop_at:
        raise RuntimeError(f"stopped at step {{step}}")
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    checkpoint(step)
"""

REFERENCE = """\
torch.manual_seed(0)
ref = Net()
ref.reset_parameters()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for step in range(10):
    loss = ref(x).pow(2).mean()
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
"""


def test_a_cell_defined_model_built_on_meta_resumes_through_autoresume(tmp_path):
    root = tmp_path / "ckpt"
    with NotebookKernel(tmp_path) as kernel:
        kernel.run("%load_ext nbtools")
        kernel.run(CLASS)
        kernel.run(SETUP + "stop_at = 5")
        with pytest.raises(CellExecutionError, match="stopped at step 5"):
            kernel.run(TRAIN.format(root=root))
        assert kernel.eval("model.scale.is_meta") is False
        # As after a kernel restart: the setup cell again, then the training cell.
        kernel.run(SETUP + "stop_at = None")
        assert kernel.eval("model.body.weight.is_meta") is True
        kernel.run(TRAIN.format(root=root))
        kernel.run(textwrap.dedent(REFERENCE))
        assert kernel.eval("model.body.weight.is_meta") is False
        assert kernel.eval("torch.equal(model.body.weight, ref.body.weight)") is True
        assert kernel.eval("torch.equal(model.scale, ref.scale)") is True
        assert kernel.eval(
            "all(torch.equal(optimizer.state[p]['momentum_buffer'], ref_opt.state[q]"
            "['momentum_buffer']) for p, q in zip(model.parameters(), ref.parameters()))"
        )
