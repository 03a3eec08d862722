"""``nbtools.compat.serverless_gpu``: the documented names, imports, arguments and errors."""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.data import DataLoader, VolumeDataset

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_imports_work_both_ways():
    from nbtools.compat import serverless_gpu
    from nbtools.compat.serverless_gpu import distributed
    from nbtools.compat.serverless_gpu.data import (
        DataLoader as DL,
    )
    from nbtools.compat.serverless_gpu.data import (
        UCVolumeDataset,
        UCVolumeReader,
        UCVolumeWriter,
    )

    assert serverless_gpu.data.UCVolumeWriter is UCVolumeWriter is VolumeWriter
    assert serverless_gpu.data.UCVolumeReader is UCVolumeReader is VolumeReader
    assert serverless_gpu.data.DataLoader is DL is DataLoader
    assert issubclass(UCVolumeDataset, VolumeDataset)
    assert serverless_gpu.distributed is distributed
    assert serverless_gpu.runtime.get_global_rank() == 0


def test_the_dataset_takes_the_documented_path_and_free_space_variable(tmp_path, monkeypatch):
    from nbtools.compat.serverless_gpu.data import UCVolumeDataset

    (tmp_path / "vol").mkdir()
    for i in range(3):
        (tmp_path / "vol" / f"{i}.bin").write_bytes(bytes([i]) * 10)
    monkeypatch.setenv("NBTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SGC_FSLAYER_MIN_FREE_DISK_BYTES", "12345")
    dataset = UCVolumeDataset(str(tmp_path / "vol"))
    assert sorted(Path(p).read_bytes()[:1] for p in dataset) == [b"\x00", b"\x01", b"\x02"]
    assert dataset.min_free_bytes == 12345
    monkeypatch.setenv("SGC_FSLAYER_MIN_FREE_DISK_BYTES", "ten percent")
    with pytest.raises(ValueError, match="SGC_FSLAYER_MIN_FREE_DISK_BYTES must be a number"):
        UCVolumeDataset(str(tmp_path / "vol"))


@pytest.mark.parametrize(
    "kwargs, line",
    [
        ({"gpus": 2, "remote": True}, "remote=True: nbtools has no remote GPU pool"),
        ({"gpus": 2, "gpu_type": "H100"}, "gpu_type='H100': nbtools does not choose GPU types"),
        ({"gpus": 2, "run_async": True}, "run_async=True: nbtools' .distributed() runs the call"),
    ],
)
def test_arguments_of_the_managed_service_give_one_line_each(kwargs, line, caplog):
    from nbtools.compat.serverless_gpu import distributed

    with caplog.at_level(logging.WARNING, logger="nbtools"):
        decorated = distributed(**kwargs)(lambda: 0)
    mine = [
        r.getMessage()
        for r in caplog.records
        if "GPU pool" in r.getMessage()
        or "GPU types" in r.getMessage()
        or "run_async" in r.getMessage()
    ]
    assert len(mine) == 1 and mine[0].startswith(line), caplog.text
    assert decorated() == 0


def test_gpus_on_a_machine_without_gpus_runs_cpu_ranks_and_says_so(caplog):
    import torch

    from nbtools.compat.serverless_gpu import distributed

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        decorated = distributed(gpus=3)(lambda: 0)
    assert decorated.processes == 3 and decorated.gpus is None
    assert "gpus=3: torch sees no GPU here; nbtools runs 3 CPU ranks" in caplog.text


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"gpus": "8"}, TypeError, "gpus must be an integer"),
        ({"gpus": 0}, ValueError, "gpus must be at least 1"),
        ({"gpus": 2, "remote": "yes"}, TypeError, "remote must be True or False"),
        ({"gpus": 2, "run_async": 1}, TypeError, "run_async must be True or False"),
        ({"gpus": 2, "gpu_type": 5}, TypeError, "gpu_type must be a GPU type name"),
        ({}, TypeError, "needs gpus=N"),
        ({"gpus": 2, "processes": 2}, ValueError, "either gpus= or nbtools' processes="),
        ({"gpus": 2, "bogus": 1}, TypeError, "bogus"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, error, words, caplog):
    from nbtools.compat.serverless_gpu import distributed

    with caplog.at_level(logging.WARNING, logger="nbtools"), pytest.raises(error, match=words):
        distributed(**kwargs)
    assert "WARNING" not in caplog.text  # nothing said about a call that did not happen


@pytest.mark.slow
def test_import_nbtools_and_its_core_never_import_compat():
    probe = (
        "import json, sys\n"
        "import nbtools, nbtools.launch, nbtools.checkpoint, nbtools.data, nbtools.runtime\n"
        "from nbtools import distributed\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nbtools.compat'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow
def test_no_module_outside_compat_imports_it():
    for path in sorted((ROOT / "nbtools").rglob("*.py")):
        if "compat" in path.relative_to(ROOT / "nbtools").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("nbtools.compat") for n in names), path
