"""A small model and training loop for the checkpoint tests.

A module of its own rather than conftest.py: several test directories have a
conftest.py, and ``from conftest import ...`` would pick whichever was imported first.
"""

from __future__ import annotations

import torch

__all__ = ["Net", "make_training", "train_step", "two_rank_reference"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def make_training(seed: int = 0):
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    import random

    import numpy as np

    x = torch.randn(8, 4) + random.random() + float(np.random.rand())
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def two_rank_reference(optimizer: type, steps: int) -> torch.nn.Linear:
    """The ``Linear(4, 4)`` an uninterrupted run of two data-parallel ranks ends with:
    seeded with 0, step ``s`` draws its batch after ``manual_seed(s)``, and the
    all-reduce of the two ranks' equal gradients doubles them (``lr=0.1``)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    opt = optimizer(net.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(step)
        opt.zero_grad()
        net(torch.randn(2, 4)).sum().backward()
        for p in net.parameters():
            p.grad.mul_(2)
        opt.step()
    return net
