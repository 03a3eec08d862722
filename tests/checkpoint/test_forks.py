"""A fork (DataLoader workers at the start of an epoch) waits for the background save in flight."""

from __future__ import annotations

import os

import torch

from nbtools.checkpoint import CheckpointManager


def test_a_fork_waits_for_the_background_save_in_flight(tmp_path):
    model = torch.nn.Linear(4096, 8192)  # 134 MB: its upload takes far longer than a fork
    with CheckpointManager(tmp_path / "ckpt", save_on_close=False) as ckpt:
        assert ckpt.save(0, model=model)
        future = ckpt._saver.future
        assert future is not None
        pid = os.fork()
        if pid == 0:
            os._exit(0 if future.done() else 3)  # the child sees the state at the fork
        _, status = os.waitpid(pid, 0)
        # Forked only once the save's threads were done: nothing they held is copied.
        assert future.done() and os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(tmp_path / "ckpt" / "step_0" / ".metadata")
