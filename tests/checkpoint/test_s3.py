"""Checkpoints and data on S3, against an S3-compatible server on loopback.

The server is moto's, started by the fixture in this process on 127.0.0.1 and a
free port, and stopped (with its thread) when the test ends. nbtools reaches
it exactly as a user reaches S3: ``s3://`` URLs through fsspec and s3fs,
configured by the standard AWS environment variables (``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request

import pytest
import torch

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from nbtools.checkpoint import (  # noqa: E402
    CheckpointManager,
    find_latest_valid,
    latest_checkpoint,
)

BUCKET = "nbtools-test"


def _reset(endpoint: str) -> None:
    """Empty the server (moto keeps its buckets in process-wide state)."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    with direct.open(request, timeout=30):
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3(monkeypatch):
    """An empty bucket on a loopback S3 server; yields the s3fs filesystem of the test."""
    port = _free_port()
    before = set(threading.enumerate())
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    _reset(endpoint)
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"])),
    }.items():
        monkeypatch.setenv(name, value)
    # fsspec caches filesystems by their arguments: a cached one would reach an old port.
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        # Close the client's kept-alive connections: the server serves each on a thread.
        s3fs.S3FileSystem.close_session(fs.loop, fs.s3)
        s3fs.S3FileSystem.clear_instance_cache()
        _reset(endpoint)
        server.stop()
        # fsspec's IO loop and that loop's executor serve the whole process, not the server;
        # so does tqdm's monitor, started by the first progress bar of the process.
        left = [
            t
            for t in set(threading.enumerate()) - before
            if not t.name.startswith(("fsspecIO", "asyncio_", "tqdm_monitor"))
        ]
        for thread in left:
            thread.join(timeout=30)
        alive = [t for t in left if t.is_alive()]
        assert alive == [], f"the S3 server left threads behind: {alive}"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _names(fs, path: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False))


def test_checkpoints_on_s3_save_retain_skip_partial_and_restore(s3):
    root = f"s3://{BUCKET}/run1/checkpoints"
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(root, every=2, keep=2) as ckpt:
        assert ckpt.restore(model=model, optimizer=opt) == 0
        for step in range(7):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.maybe_save(step, model=model, optimizer=opt, extra={"step": step})
    # Saved at 0, 2, 4, 6 (and nothing newer on close); keep=2 left the newest two.
    assert _names(s3, f"{BUCKET}/run1/checkpoints") == ["step_4", "step_6"]
    assert ".metadata" in _names(s3, f"{BUCKET}/run1/checkpoints/step_6")

    # A save that died before publishing: shards, no .metadata. It is never picked.
    s3.pipe_file(f"{BUCKET}/run1/checkpoints/step_9/__0_0.distcp", b"partial")
    assert latest_checkpoint(root) == (6, f"{root}/step_6")
    assert find_latest_valid(root) == f"{root}/step_6"

    restored = _model(1)
    restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(root, keep=2, save_on_close=False) as again:
        assert again.restore(model=restored, optimizer=restored_opt) == 7
        assert again.extra == {"step": 6}
    torch.testing.assert_close(restored.state_dict(), model.state_dict())
    torch.testing.assert_close(restored_opt.state_dict()["state"], opt.state_dict()["state"])


def test_volume_dataset_reads_files_from_s3(s3, tmp_path):
    from nbtools.data import VolumeDataset

    files = {f"images/{i:03d}.bin": bytes([i]) * (100 + i) for i in range(12)}
    for name, data in files.items():
        s3.pipe_file(f"{BUCKET}/{name}", data)
    dataset = VolumeDataset(f"s3://{BUCKET}/images", cache_dir=tmp_path / "cache")
    seen = {}
    for local in dataset:
        with open(local, "rb") as fh:
            seen[local.rsplit("/", 1)[1]] = fh.read()
    assert seen == {name.rsplit("/", 1)[1]: data for name, data in files.items()}
