"""Where a restore puts tensors on a machine with GPUs, tested on the CPU.

``torch.cuda.is_available`` is patched where a test needs a machine with CUDA
(the hardware boundary); a stateful object's tensor saved on a GPU is stood in
for by a storage that ``torch.save`` tags ``cuda:1``, as it would on that GPU.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.serialization as serialization
from torch import nn

from nbtools.checkpoint import CheckpointManager, _meta


@pytest.fixture
def cuda_available(monkeypatch):
    """A machine where CUDA is available (and no warning was given yet)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_meta, "_warned_cpu", False)


def _meta_net() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "meta model" in str(w.message)]


def test_a_meta_restore_onto_the_cpu_warns_once_when_cuda_is_available(tmp_path, cuda_available):
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        net = _meta_net()
        (message,) = _warnings(lambda: ckpt.restore(model=net))
        assert "device='cuda'" in message
        assert all(p.device.type == "cpu" for p in net.parameters())
        assert _warnings(lambda: ckpt.restore(model=_meta_net())) == []  # once per process


def test_no_warning_with_a_device_given_or_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(_meta, "_warned_cpu", False)
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        assert _warnings(lambda: ckpt.restore(model=_meta_net())) == []  # no CUDA here
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert _warnings(lambda: ckpt.restore(model=_meta_net(), device="cpu")) == []
        assert _warnings(lambda: ckpt.restore(model=nn.Linear(2, 2))) == []  # no meta model


class _OnGpu:
    """A stateful object whose state was saved on GPU 1 (its storage is tagged so)."""

    def __init__(self) -> None:
        self.value = torch.arange(4.0)

    def state_dict(self) -> dict:
        self.value.untyped_storage().nbtools_saved_on = "cuda:1"  # type: ignore[attr-defined]
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _tag(obj: object) -> str | None:
    return getattr(obj, "nbtools_saved_on", None)


@contextlib.contextmanager
def _gpu_tags() -> Iterator[None]:
    """``torch.save`` writes the location of tagged storages as a GPU's."""
    serialization.register_package(1, _tag, lambda obj, location: None)
    try:
        yield
    finally:
        registry = serialization._package_registry
        registry[:] = [entry for entry in registry if entry[1] is not _tag]


def test_objects_saved_on_a_gpu_come_back_on_the_rank_device(tmp_path):
    raw = io.BytesIO()
    with _gpu_tags():
        torch.save({"value": _OnGpu().state_dict()["value"]}, raw)
    with pytest.raises(RuntimeError, match="CUDA"):  # what torch does without a location
        torch.load(io.BytesIO(raw.getvalue()), weights_only=True)

    with _gpu_tags(), CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        ckpt.save(1, model=nn.Linear(2, 2), counter=_OnGpu())
    restored = _OnGpu()
    restored.value = torch.zeros(4)
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        assert ckpt.restore(model=nn.Linear(2, 2), counter=restored) == 2
    # This rank's device is the CPU (no NCCL group): the state lands there, whole.
    assert restored.value.device.type == "cpu"
    assert torch.equal(restored.value, torch.arange(4.0))
