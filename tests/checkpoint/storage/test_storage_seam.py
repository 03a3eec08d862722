"""One typed storage target, one notion of a location, one layout module."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools._internal.location import is_url, local_path, unwritable_reason, url_protocols
from nbtools.checkpoint import (
    CheckpointManager,
    VolumeWriter,
    find_latest_valid,
    latest_checkpoint,
)
from nbtools.checkpoint._storage import _mounts
from nbtools.checkpoint._storage._target import FsspecTarget, LocalTarget, Target, open_target

PACKAGE = Path(__file__).resolve().parents[3] / "nbtools"


@pytest.mark.parametrize(
    ("location", "url", "path"),
    [
        ("/mnt/vol/x", False, "/mnt/vol/x"),
        ("file:///mnt/vol/x", False, "/mnt/vol/x"),
        ("s3://bucket/x", True, None),
        ("memory://x", True, None),
        ("simplecache::s3://bucket/x", True, None),
    ],
)
def test_one_notion_of_a_location(location, url, path):
    assert is_url(location) is url
    assert local_path(location) == path
    if path is not None:
        assert isinstance(open_target(location), LocalTarget)
    elif location.startswith("memory://"):
        assert isinstance(open_target(location), FsspecTarget)


def test_relative_paths_and_protocols():
    assert local_path("rel/dir") == os.path.abspath("rel/dir")
    assert url_protocols("simplecache::s3://b/x") == ["simplecache", "s3"]
    assert url_protocols("/x") == []


def test_unwritable_reason(tmp_path):
    assert unwritable_reason(str(tmp_path / "new" / "deeper")) is None
    (tmp_path / "file").write_text("x")
    assert "not a directory" in unwritable_reason(str(tmp_path / "file" / "below"))


def test_targets_fill_in_the_whole_protocol(tmp_path):
    url = f"memory://seam-{uuid.uuid4().hex}/root"
    try:
        for target in (LocalTarget(tmp_path / "root"), FsspecTarget(url)):
            assert isinstance(target, Target)
            assert isinstance(target.child("step_1"), Target)
            target.makedirs("step_1")
            target.publish_bytes("step_1/.metadata", b"abc")
            assert target.child("step_1").read_bytes(".metadata") == b"abc"
            assert target.child("step_1").size(".metadata") == 3
            assert target.listdir() == ["step_1"]
            assert target.foreign("step_1") is None and target.link("step_1") is None
        assert LocalTarget(tmp_path).local_path == str(tmp_path)
        assert FsspecTarget(url).local_path is None and FsspecTarget(url).remote
    finally:
        fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


def test_callers_never_ask_which_kind_of_storage_they_hold():
    kinds = {"LocalTarget", "FsspecTarget"}
    offenders = []
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        if path.name == "_target.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in kinds:
                offenders.append(f"{path.name}:{node.lineno} {node.id}")
    assert offenders == []


def test_mounts_are_read_once_per_filesystem(tmp_path, monkeypatch):
    import psutil

    calls = []
    real = psutil.disk_partitions

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(psutil, "disk_partitions", counted)
    monkeypatch.setattr(_mounts, "_FSTYPE_BY_DEV", {})
    for step in range(3):
        dcp.save(
            {"w": torch.ones(2) * step},
            storage_writer=VolumeWriter(tmp_path / f"s{step}"),
            no_dist=True,
        )
    with CheckpointManager(tmp_path / "root", async_save=False) as ckpt:
        for step in range(3):
            ckpt.save(step, model=torch.nn.Linear(2, 2))
    assert len(calls) == 1


def test_latest_checkpoint_gives_step_and_path(tmp_path):
    root = tmp_path / "root"
    assert latest_checkpoint(root) is None
    with CheckpointManager(f"file://{root}", async_save=False) as ckpt:
        ckpt.save(5, model=torch.nn.Linear(2, 2))
        ckpt.save(12, model=torch.nn.Linear(2, 2))
        assert ckpt.root == str(root)
    step, path = latest_checkpoint(root)
    assert (step, path) == (12, str(root / "step_12")) == (step, find_latest_valid(root))
    (root / "step_40").mkdir()  # a save that never published
    assert latest_checkpoint(root).step == 12
    with pytest.raises(TypeError):
        latest_checkpoint(root, verify="yes")


@pytest.mark.slow
def test_importing_checkpoint_changes_no_warning_filter():
    # torch, numpy and sympy add filters of their own when imported: import them first.
    probe = (
        "import json, warnings\n"
        "import torch, torch.distributed.checkpoint, torch.distributed.checkpoint.state_dict\n"
        "before = list(warnings.filters)\n"
        "import nbtools.checkpoint\n"
        "print(json.dumps(list(map(repr, warnings.filters)) == list(map(repr, before))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) is True


@pytest.mark.parametrize("async_save", [True, False])
def test_single_process_saves_hide_only_dcps_single_process_warning(tmp_path, async_save):
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with CheckpointManager(tmp_path / "root", async_save=async_save) as ckpt:
            ckpt.save(1, model=model)
            ckpt.wait()
            assert CheckpointManager(tmp_path / "root").restore(model=model) == 2
        warnings.warn("a user's own warning", UserWarning, stacklevel=1)
    messages = [str(w.message) for w in seen]
    assert "a user's own warning" in messages
    assert not any("single process" in m for m in messages)
