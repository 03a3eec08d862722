"""Sources that change under the cache: truncated mid-copy, rewritten between epochs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from nbtools.data import VolumeDataset
from nbtools.errors import DataError

_GIB = 1 << 30
_MIB = 1 << 20


def _copy_position(path: str) -> int | None:
    """How far this process has read ``path`` (from ``/proc/self/fdinfo``), or None."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != path:
                continue
            with open(f"/proc/self/fdinfo/{fd}") as fh:
                return int(fh.readline().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


class _Truncator(threading.Thread):
    """Truncates ``path`` to ``to`` bytes once a copy has read past ``at`` bytes of it."""

    def __init__(self, path: str, at: int, to: int) -> None:
        super().__init__(daemon=True)
        self.path, self.at, self.to = path, at, to
        self.read_when_cut: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.0005):
            pos = _copy_position(self.path)
            if pos is not None and pos >= self.at:
                os.truncate(self.path, self.to)
                self.read_when_cut = pos
                return


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs /proc")


@needs_proc
@pytest.mark.slow
def test_a_1gib_source_truncated_during_its_copy_is_copied_again_not_served_partial(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    big = src / "big.bin"
    with open(big, "wb") as fh:
        fh.truncate(_GIB)  # sparse: 1 GiB of zeros on the volume
    files = VolumeDataset(src, cache_dir=tmp_path / "cache", prefetch=1)
    cutter = _Truncator(os.path.realpath(big), at=64 * _MIB, to=16 * _MIB)
    cutter.start()
    try:
        (path,) = list(files)
    finally:
        cutter.stop.set()
        cutter.join()
    assert cutter.read_when_cut is not None and cutter.read_when_cut < _GIB, "cut mid-copy"
    # The copy holds the file as it is now, never the bytes read before the cut.
    assert os.path.getsize(path) == os.path.getsize(big) == 16 * _MIB


_APPEND = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
os.write(fd, b"x" * 4096)
print("appending", flush=True)
while True:
    os.write(fd, b"x" * 4096)
"""


@needs_proc
def test_a_source_that_keeps_changing_during_its_copies_is_an_error_naming_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    grows = src / "grows.bin"
    grows.write_bytes(b"\0" * (32 * _MIB))
    # A writer that never finishes, in a process of its own: another program appending, which
    # goes on while this one copies, even when a busy machine leaves this process's threads
    # waiting for the interpreter lock.
    files = VolumeDataset(src, cache_dir=tmp_path / "cache", prefetch=1)
    writer = subprocess.Popen(
        [sys.executable, "-c", _APPEND, str(grows)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "appending\n"
        with pytest.raises(DataError, match="grows.bin changed while it was copied"):
            list(files)
    finally:
        writer.kill()
        writer.communicate()
    leftovers = [
        n for _, _, names in os.walk(tmp_path / "cache") for n in names if n.startswith("grows")
    ]
    assert leftovers == []  # nothing partial is left under the file's name


def _rewrite(target, new: bytes) -> None:
    """Rewrite ``target`` in place (its directory does not change), one second newer."""
    before = os.stat(target)
    target.write_bytes(new)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


def _two_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"old content")
    (src / "b.bin").write_bytes(b"other")
    return src, src / "a.bin"


def _read_all(files) -> dict[str, bytes]:
    return {os.path.basename(p): open(p, "rb").read() for p in files}


@pytest.mark.parametrize("mode", ["epoch", True])
@pytest.mark.parametrize("change", ["size", "mtime"])
def test_a_source_rewritten_between_epochs_is_copied_again_when_every_epoch_checks(
    tmp_path, change, mode
):
    src, target = _two_files(tmp_path)
    files = VolumeDataset(src, cache_dir=tmp_path / "cache", check_sources=mode)
    assert _read_all(files)["a.bin"] == b"old content"
    new = b"new content, longer" if change == "size" else b"new content"
    _rewrite(target, new)
    assert _read_all(files) == {"a.bin": new, "b.bin": b"other"}  # same dataset, next epoch


@pytest.mark.parametrize("change", ["size", "mtime"])
def test_a_source_rewritten_after_a_launch_is_copied_again_by_the_next(tmp_path, change):
    src, target = _two_files(tmp_path)
    cache = tmp_path / "cache"
    assert _read_all(VolumeDataset(src, cache_dir=cache))["a.bin"] == b"old content"
    new = b"new content, longer" if change == "size" else b"new content"
    _rewrite(target, new)
    # A new launch reuses the index (no directory changed) and the cached copies,
    # but looks at every source in its first epoch.
    assert _read_all(VolumeDataset(src, cache_dir=cache)) == {"a.bin": new, "b.bin": b"other"}


def test_the_default_looks_at_each_source_once_per_launch_then_trusts_the_copies(tmp_path):
    src, target = _two_files(tmp_path)
    files = VolumeDataset(src, cache_dir=tmp_path / "cache")
    assert _read_all(files)["a.bin"] == b"old content"  # epoch 0 looked at both sources
    _rewrite(target, b"new content, longer")
    # Later epochs of the launch serve the copies the first epoch checked (see
    # check_sources): no metadata request per file and epoch to the volume.
    assert _read_all(files)["a.bin"] == b"old content"
    assert _read_all(VolumeDataset(src, cache_dir=tmp_path / "cache"))["a.bin"] == (
        b"new content, longer"
    )


def test_a_launch_resumed_part_way_looks_at_the_sources_it_skipped_in_its_next_epoch(tmp_path):
    src, target = _two_files(tmp_path)
    cache = tmp_path / "cache"
    first = VolumeDataset(src, cache_dir=cache)
    assert _read_all(first)["a.bin"] == b"old content"  # both cached
    it = iter(first)
    assert os.path.basename(next(it)) == "a.bin"
    state = first.state_dict()  # a.bin consumed in epoch 1
    it.close()
    _rewrite(target, b"new content, longer")
    resumed = VolumeDataset(src, cache_dir=cache)
    resumed.load_state_dict(state)
    assert _read_all(resumed) == {"b.bin": b"other"}  # the rest of epoch 1, checked
    # Epoch 1 was not looked at whole in this launch: epoch 2 looks at every source.
    assert _read_all(resumed) == {"a.bin": b"new content, longer", "b.bin": b"other"}
    _rewrite(target, b"newer still")
    assert _read_all(resumed)["a.bin"] == b"new content, longer"  # epoch 2 covered the launch


@pytest.mark.parametrize("bad", ["always", 1, None, 0.5])
def test_check_sources_takes_launch_epoch_or_false_and_says_so(tmp_path, bad):
    with pytest.raises(ValueError, match="check_sources must be 'launch'.*'epoch'.*False"):
        VolumeDataset(tmp_path, check_sources=bad)
