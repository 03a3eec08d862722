"""A pool on a GPU: device state stays between calls, and status shows device memory."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_cuda_tensor_stays_on_the_rank_between_calls():
    from nbtools.launch import RankPool

    with RankPool(gpus=1, output="none") as pool:
        pool.execute(
            "import torch\nimport torch.distributed as dist\n"
            "held = torch.ones(1024, 1024, device='cuda')\nptr = held.data_ptr()"
        )
        assert pool.execute("held.device.type, held.data_ptr() == ptr") == [("cuda", True)]
        assert pool.execute("dist.all_reduce(held)\nheld[0, 0].item()") == [1.0]
        (row,) = pool.status()
        assert row["device"] == "cuda:0" and row["allocated"] >= 4 * 1024 * 1024
        assert pool.execute("held.data_ptr() == ptr") == [True]
