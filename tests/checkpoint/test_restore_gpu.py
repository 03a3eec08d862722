"""The read-once hand-off into CUDA tensors over NCCL (run on a machine with 2 GPUs)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools import distributed
from nbtools.checkpoint import VolumeReader, VolumeWriter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def test_replicated_state_is_handed_over_into_cuda_tensors_over_nccl(tmp_path):
    torch.manual_seed(0)
    saved = {"w": torch.randn(1024, 1024), "b": torch.randn(1024), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, storage_writer=VolumeWriter(tmp_path / "ckpt"))

    @distributed(gpus=2)
    def job(path: str, stage: str) -> dict:
        import torch.distributed as dist

        rank = dist.get_rank()
        facts = {}
        nccl = dist.new_group(backend="nccl")
        for name, group in (("mixed", None), ("nccl", nccl)):
            got = {
                "w": torch.zeros(1024, 1024, device="cuda"),
                "b": torch.zeros(1024, device="cuda"),
                "step": 0,
            }
            reader = VolumeReader(
                path,
                stage=True,  # staged, so that the ranks share one read
                staging_dir=os.path.join(stage, f"{name}-{rank}"),
                process_group=group,
                chunk_size=1 << 20,
                min_chunk_size=1 << 18,
            )
            dcp.load(got, storage_reader=reader, process_group=group)
            facts[name] = {
                k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in got.items()
            }
            facts[name + "_device"] = got["w"].device.type
        dist.destroy_process_group(nccl)
        return facts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = job.distributed(str(tmp_path / "ckpt"), str(tmp_path / "stage"))
    for facts in results:
        for name in ("mixed", "nccl"):
            assert facts[name + "_device"] == "cuda"
            assert torch.equal(facts[name]["w"], saved["w"])
            assert torch.equal(facts[name]["b"], saved["b"])
            assert facts[name]["step"] == 7
