"""VolumeDataset over a real FUSE mount that adds latency to every open (root + FUSE only)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest
from torch.utils.data import IterableDataset

from nbtools.data import DataLoader, VolumeDataset
from nbtools.errors import DataError

_SERVER = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "_slowfs.py")


def _fuse_ready() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return "needs /dev/fuse and fusermount3 (Debian fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"needs mfusepy and libfuse3: {exc}"
    return None


class _Bytes(IterableDataset):
    def __init__(self, files):
        self.files = files

    def __iter__(self):
        for path in self.files:
            with open(path, "rb") as fh:
                yield os.path.basename(path), fh.read()


@contextlib.contextmanager
def mounted(src, mnt, *options: str):
    """``src`` served at ``mnt`` by the FUSE server with ``options``; unmounted afterwards."""
    reason = _fuse_ready()
    if reason:
        pytest.skip(reason)
    os.makedirs(mnt, exist_ok=True)
    server = subprocess.Popen(
        [sys.executable, _SERVER, str(src), str(mnt), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mnt):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.skip("the FUSE server could not mount here")
            time.sleep(0.05)
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def slow_mount(tmp_path):
    reason = _fuse_ready()
    if reason:
        pytest.skip(reason)
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    for i in range(24):
        (src / f"f{i:02d}.bin").write_bytes(bytes([i]) * 50_000)
    with mounted(src, mnt, "--open-ms", "5", "--read-ms", "0") as path:
        yield path


@pytest.mark.root
def test_files_on_a_slow_fuse_mount_are_served_from_the_cache(slow_mount, tmp_path):
    files = VolumeDataset(slow_mount, cache_dir=tmp_path / "cache")
    with DataLoader(_Bytes(files), batch_size=4, num_workers=2, collate_fn=list) as loader:
        for _ in range(2):
            got = dict(item for batch in loader for item in batch)
            assert got == {f"f{i:02d}.bin": bytes([i]) * 50_000 for i in range(24)}
    cached = sorted(
        n for _, _, names in os.walk(tmp_path / "cache") for n in names if n.endswith(".bin")
    )
    assert cached == [f"f{i:02d}.bin" for i in range(24)]


@pytest.mark.root
@pytest.mark.slow
def test_a_1gib_file_that_shrinks_on_the_volume_during_its_copy_is_never_served_partial(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    with open(src / "big.bin", "wb") as fh:
        fh.truncate(1 << 30)  # sparse
    # The volume cuts the file to 110 MB when the copy reaches 120 MB, as a writer would.
    options = (
        "--open-ms",
        "0",
        "--read-ms",
        "0",
        "--shrink-at",
        "120000000",
        "--shrink-to",
        "110000000",
    )
    with mounted(src, mnt, *options):
        files = VolumeDataset(mnt, cache_dir=tmp_path / "cache", prefetch=1)
        try:
            (path,) = list(files)
        except DataError as exc:  # the volume kept showing the old size: refused, named
            assert "big.bin" in str(exc)
        else:
            assert os.path.getsize(path) == 110_000_000  # the file as it now is
    assert os.path.getsize(src / "big.bin") == 110_000_000  # it did shrink mid-copy
