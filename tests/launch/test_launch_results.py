"""A rank's return value pickled once, large buffers out of band, and read back exactly."""

from __future__ import annotations

import errno
import os
import tempfile

import numpy as np
import pytest
import torch

from nbtools import DistributedError, distributed
from nbtools.launch import _results


def _roundtrip(value, tmp_path):
    path = str(tmp_path / "result.pkl")
    _results.dump(value, path)
    framed = _results.load(path)
    return framed, framed.loads()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
def test_large_tensors_travel_out_of_band_and_come_back_equal(tmp_path, dtype):
    source = (torch.arange(300_000) % 7).to(dtype)
    framed, back = _roundtrip({"t": source, "n": 3}, tmp_path)
    assert len(framed.buffers) == 1  # the tensor's bytes are not inside the pickle
    assert len(framed.data) < 10_000
    assert back["n"] == 3 and back["t"].dtype == dtype and torch.equal(back["t"], source)
    back["t"][0] = back["t"][1]  # writable, like any tensor the caller owns


def test_views_parameters_and_small_values_keep_their_meaning(tmp_path):
    base = torch.randn(400, 300)
    param = torch.nn.Parameter(torch.randn(200, 200))
    array = np.arange(100_000, dtype=np.float32)
    value = {
        "t": base.t(),
        "p": param,
        "a": array,
        "small": torch.arange(3),
        "empty": torch.empty(0, 5),
    }
    framed, back = _roundtrip(value, tmp_path)
    assert torch.equal(back["t"], base.t())
    assert isinstance(back["p"], torch.nn.Parameter) and torch.equal(back["p"], param)
    assert back["p"].requires_grad
    assert np.array_equal(back["a"], array)
    assert torch.equal(back["small"], torch.arange(3)) and back["empty"].shape == (0, 5)
    assert len(framed.buffers) >= 2  # the transposed tensor and the array


def test_a_truncated_result_file_is_an_error_not_a_value(tmp_path):
    path = str(tmp_path / "result.pkl")
    _results.dump(torch.zeros(100_000), path)
    with open(path, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(ValueError, match="not a complete result file"):
        _results.load(path)


@pytest.mark.slow
def test_ranks_return_1_mib_and_large_tensors_exactly():
    @distributed(processes=2, output="none")
    def tensors(n):
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        return {"mib": torch.full((262_144,), float(rank)), "big": torch.arange(n) + rank}

    n = 64 * 1024 * 1024 // 8  # 64 MiB of int64 per rank
    results = tensors.distributed(n)
    for rank, value in enumerate(results):
        assert value["mib"].nbytes == 1024 * 1024 and bool((value["mib"] == rank).all())
        assert torch.equal(value["big"], torch.arange(n) + rank)


@pytest.mark.slow
def test_a_1_gib_return_value_arrives_whole():
    @distributed(processes=2, output="none")
    def one_gib():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            return torch.ones(1024**3 // 4)
        return None

    first, second = one_gib.distributed()
    assert second is None and first.nbytes == 1024**3 and float(first.sum()) == 1024**3 // 4


def test_a_write_that_fails_midway_leaves_no_partial_file(mount_tmpfs, monkeypatch):
    mnt = mount_tmpfs("1m")
    path = str(mnt / "result.pkl")

    # As on a filesystem without fallocate: the disk fills during the write itself.
    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    with pytest.raises(OSError) as info:
        _results.dump(torch.zeros(2 * 1024 * 1024 // 4), path)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(mnt) == []


@pytest.mark.slow
def test_a_return_value_larger_than_tmpdir_names_rank_size_dir_and_fix(mount_tmpfs, monkeypatch):
    mnt = mount_tmpfs("64m")
    monkeypatch.setattr(tempfile, "tempdir", str(mnt))

    @distributed(processes=2, output="none")
    def big():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            return torch.ones(100 * 1000 * 1000 // 4)  # 100 MB
        return 1

    with pytest.raises(DistributedError) as info:
        big.distributed()
    message = str(info.value)
    assert "rank 1: its return value (100 MB) could not be written to" in message
    assert str(mnt) in message and "no space left on device" in message
    assert "free space in TMPDIR or return less" in message
    assert "ResultWriteError" in message
    assert "cannot be sent back" not in message and "without raising" not in message
    assert os.listdir(mnt) == []  # nothing half-written stays on the full disk

    # Once the space is back, the same call works.
    monkeypatch.setattr(tempfile, "tempdir", None)
    results = big.distributed()
    assert results[0] == 1 and results[1].nbytes == 100 * 1000 * 1000


def test_an_unpicklable_part_is_named_by_its_path_inside_the_value():
    import threading

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)
            self.inner.lock = threading.Lock()

    value = {"model": Holder(), "n": [1, 2]}
    assert _results.find_unpicklable(value) == 'result["model"].inner.lock (a lock)'.replace(
        '"', "'"
    )
    assert _results.find_unpicklable({"ok": torch.ones(3)}) is None


CELL_MODEL_SCRIPT = """
import threading
import torch
from nbtools import DistributedError, distributed

class Net(torch.nn.Module):  # lives in __main__, as a class from a notebook cell does
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(256, 256)  # 256 KiB of weights: out of band

    def forward(self, x):
        return self.body(x)

@distributed(processes=2, output="none")
def train():
    torch.manual_seed(0)
    return {"model": Net(), "step": 3}

results = train.distributed()
assert all(type(r["model"]).__name__ == "Net" for r in results), results
x = torch.ones(1, 256)
assert torch.equal(results[0]["model"](x), results[1]["model"](x))
assert results[1]["model"].body.weight.is_contiguous()

@distributed(processes=2, output="none")
def locked():
    net = Net()
    net.lock = threading.Lock()
    return {"model": net}

try:
    locked.distributed()
except DistributedError as exc:
    print(exc)
else:
    raise AssertionError("a lock came back")
"""


@pytest.mark.slow
def test_a_model_of_a_class_from_main_comes_back_from_every_rank(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(CELL_MODEL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "result['model'].lock (a lock) cannot be pickled" in proc.stdout, proc.stdout
    assert "PicklingError" in proc.stdout
