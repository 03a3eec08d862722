"""The loader in a process where CUDA is already initialised, with pinned memory (GPU only)."""

from __future__ import annotations

import pytest
import torch
from _data_helpers import Indices

from nbtools.data import DataLoader, VolumeDataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_forked_workers_after_cuda_init_and_pinned_batches(tree):
    src, cache = tree
    torch.zeros(1, device="cuda")  # CUDA is initialised before the workers fork
    files = VolumeDataset(src, cache_dir=cache)
    with DataLoader(Indices(files), batch_size=8, num_workers=2, pin_memory=True) as loader:
        seen = []
        for batch in loader:
            assert batch.is_pinned()
            seen += batch.to("cuda", non_blocking=True).cpu().tolist()
    assert sorted(seen) == list(range(40))
