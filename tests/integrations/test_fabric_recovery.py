"""Lightning Fabric in a real kernel: what ``fabric.setup()`` and
``fabric.setup_dataloaders()`` return goes to ``CheckpointManager`` as it is; a rank
killed mid-epoch resumes from memory by the manager alone (see ``_own_loop``).

Fabric wraps the model (in DDP), the optimizer and torchdata's ``StatefulDataLoader``
over a ``DistributedSampler``, whose epoch it sets as each pass starts.
"""

from __future__ import annotations

import pytest
from _own_loop import check_killed_rank_resumes
from _user_code_nb import requires

pytestmark = [pytest.mark.slow, pytest.mark.kernel, requires("lightning", "torchdata")]


def test_a_killed_rank_resumes_from_memory_and_ends_like_an_uninterrupted_run(tmp_path):
    setup = """\
    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    net = Net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.7)
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=1)
    loader = fabric.setup_dataloaders(StatefulDataLoader(data, BATCH, sampler=sampler))
    """
    check_killed_rank_resumes(tmp_path, setup, backward="fabric.backward")
