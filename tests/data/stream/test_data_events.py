"""The data side of the run's timeline: ``input_stall`` and ``cache_full`` events."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
from torch.utils.data import IterableDataset

from nbtools import events
from nbtools._hangs import Watchdog
from nbtools.data import DataLoader, VolumeDataset
from nbtools.data._stream import _spec as _window
from nbtools.data.loader import MIN_STALL_S, StallWatch

pytestmark = pytest.mark.usefixtures("clean_bus")


def test_a_wait_much_longer_than_usual_is_a_stall():
    watch = StallWatch()
    assert not watch.observe(5.0, first=True)  # starting the workers is not a stall
    assert not watch.observe(2.0)  # nothing known yet about the usual wait
    for _ in range(5):
        assert not watch.observe(0.01)
    assert not watch.observe(MIN_STALL_S / 2)  # long relative to usual, short in absolute terms
    assert watch.observe(1.5)
    (stall,) = events.log(kinds=["input_stall"])
    assert stall.fields["seconds"] == 1.5 and stall.fields["usual_s"] == 0.01
    assert "waited 1.50 s" in stall.message
    for _ in range(40):  # a loader that is always this slow is no longer stalling
        watch.observe(1.5)
    assert len(events.log(kinds=["input_stall"])) < 10


def test_the_loader_reports_a_slow_batch(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(16):
        (src / f"{i:02d}.txt").write_text(str(i))

    class Numbers(IterableDataset):  # as a notebook cell defines it
        def __init__(self, files):
            self.files = files

        def __iter__(self):
            for position, path in enumerate(self.files):
                if position == 10:
                    time.sleep(1.0)  # a slow read on the volume
                with open(path) as fh:
                    yield torch.tensor([float(fh.read())])

    files = VolumeDataset(src, cache_dir=tmp_path / "cache")
    with DataLoader(Numbers(files), batch_size=2, num_workers=0) as loader:
        batches = list(loader)
    assert len(batches) == 8
    (stall,) = events.log(kinds=["input_stall"])
    assert stall.fields["seconds"] >= 1.0 and stall.fields["seconds"] == pytest.approx(
        max(loader.wait_times), abs=1e-3
    )


def test_a_shrunken_copy_ahead_window_is_an_event(monkeypatch):
    monkeypatch.setattr(_window, "_WARNED", set())
    cache = types.SimpleNamespace(dir="/cache/dir", capacity=10_000, min_free=1_000)
    _window.check_window(cache, budget=3_000, largest=1_000, prefetch=8)
    _window.check_window(cache, budget=3_000, largest=1_000, prefetch=8)  # said once
    (full,) = events.log(kinds=["cache_full"])
    assert full.fields["cache_dir"] == "/cache/dir" and "copying ahead 2 files" in full.message


@pytest.mark.slow
def test_a_loop_over_the_loader_alone_is_seen_progressing_by_the_kernel(tree):
    src, cache = tree
    code = f"""
        from nbtools.data import DataLoader, VolumeDataset
        files = VolumeDataset({str(src)!r}, cache_dir={str(cache)!r})
        seen = 0
        for batch in DataLoader(files, batch_size=4, num_workers=0):
            seen += len(batch)   # no other nbtools call in the loop
        assert seen == 40, seen
    """
    bus = events.Bus()
    dog = Watchdog(world_size=1, bus=bus).start()
    try:
        with events.Collector(bus=bus) as collector:
            env = dict(os.environ, **collector.environment(), RANK="2")
            subprocess.run(
                [sys.executable, "-c", textwrap.dedent(code)], env=env, check=True, timeout=120
            )
            collector.drain()
        reports = [e for e in bus.log() if e.kind == "progress"]
        assert reports and all(e.rank == 2 for e in reports)
        assert reports[-1].fields["steps"] == 10  # one per batch the loop received
        assert dog.reporting and not dog.flags()
    finally:
        dog.stop()
