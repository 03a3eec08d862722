"""accelerate in a real kernel: what ``accelerator.prepare()`` returns (model, optimizer,
scheduler and a plain shuffling ``DataLoader``) goes to ``CheckpointManager`` as it is;
a rank killed mid-epoch resumes from memory by the manager alone (see ``_own_loop``).

accelerate wraps the model in DDP, the optimizer and scheduler in its own classes, and
shards the loader's batches between the ranks from a generator it synchronises as each
pass starts.
"""

from __future__ import annotations

import pytest
from _own_loop import check_killed_rank_resumes
from _user_code_nb import requires

pytestmark = [pytest.mark.slow, pytest.mark.kernel, requires("accelerate")]


def test_a_killed_rank_resumes_from_memory_and_ends_like_an_uninterrupted_run(tmp_path):
    setup = """\
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.7)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    model, opt, sched, loader = accelerator.prepare(net, opt, sched, loader)
    """
    check_killed_rank_resumes(tmp_path, setup, backward="accelerator.backward")


def test_a_rank_killed_between_two_accumulated_steps_resumes_where_the_optimizer_steps(
    tmp_path,
):
    # Two micro-batches per optimizer step: the kill comes after the snapshot of step 12,
    # the third micro-batch of the second pass, whose gradients the optimizer has yet to
    # use. The Accelerator, given to the manager, puts back its count and those gradients.
    setup = """\
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.7)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    model, opt, sched, loader = accelerator.prepare(net, opt, sched, loader)
    """
    check_killed_rank_resumes(
        tmp_path,
        setup,
        backward="accelerator.backward",
        context="accelerator.accumulate(model)",
        more="accelerator=accelerator",
    )
