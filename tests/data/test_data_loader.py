"""DataLoader over VolumeDataset: persistent workers, received-only position, exact resume."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

import pytest
import torch
from _data_helpers import content, index_of, make_tree
from torch.utils.data import IterableDataset

from nbtools.data import DataLoader, VolumeDataset
from nbtools.data._cache._file_cache import TMP_PREFIX
from nbtools.errors import DataError


class Decode(IterableDataset):
    """The usual wrapper: one sample per cached path, as it arrives."""

    def __init__(self, files, delay: float = 0.0):
        self.files = files
        self.delay = delay

    def __iter__(self):
        for path in self.files:
            with open(path, "rb") as fh:
                fh.read()
            if self.delay:
                time.sleep(self.delay)
            yield torch.tensor([index_of(path), os.getpid()])


class Forwarding(IterableDataset):
    """A wrapper that hides its dataset but forwards the position."""

    def __init__(self, files):
        self._get = lambda: files

    def __iter__(self):
        for path in self._get():
            yield index_of(path)

    def state_dict(self):
        return self._get().state_dict()

    def load_state_dict(self, state):
        self._get().load_state_dict(state)


def _ids(batch):
    return batch[:, 0].tolist()


def _loader(src, cache, workers, batch_size=3, check_sources="launch", **kw):
    files = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=11, check_sources=check_sources)
    return DataLoader(Decode(files), batch_size=batch_size, num_workers=workers, **kw)


@pytest.mark.parametrize("check", ["launch", "epoch", False])
def test_workers_persist_across_epochs_and_false_is_overridden(tree, check):
    # The workers' next plan (whether it looks at the sources included) is the
    # one the loader predicts, so they are not started again.
    src, cache = tree
    with pytest.warns(UserWarning, match="persistent_workers=False is ignored"):
        loader = _loader(src, cache, 2, check_sources=check, persistent_workers=False)
    with loader:
        assert loader.persistent_workers and loader.prefetch_factor == 4
        pids = []
        for _ in range(3):
            batches = list(loader)
            assert sorted(i for b in batches for i in _ids(b)) == list(range(40))
            pids.append({p for b in batches for p in b[:, 1].tolist()})
            assert len(loader.wait_times) == len(batches)
        assert pids[0] == pids[1] == pids[2] and os.getpid() not in pids[0]


def test_position_counts_only_received_batches(tree):
    src, cache = tree
    with _loader(src, cache, 2, batch_size=4) as loader:
        it = iter(loader)
        first = next(it)
        time.sleep(0.3)  # let the workers prefetch several more batches
        state = loader.state_dict()["datasets"][0]
        assert state["prefix"] + len(state["extras"]) == len(_ids(first)) == 4
        del it


@pytest.mark.parametrize(("before", "after"), [(2, 2), (0, 2), (2, 1), (1, 2)])
def test_resume_with_other_workers_sees_the_rest_exactly_once(tree, before, after):
    src, cache = tree
    with _loader(src, cache, after) as reference:
        uninterrupted = [[_ids(b) for b in reference] for _ in range(2)]
    with _loader(src, cache, before) as loader:
        seen = []
        for batch in loader:
            seen.append(_ids(batch))
            if len(seen) == 5:
                break
        state = loader.state_dict()
    with _loader(src, cache, after) as resumed:
        resumed.load_state_dict(state)
        rest = [_ids(b) for b in resumed]
        flat = [i for b in seen + rest for i in b]
        assert sorted(flat) == list(range(40))
        if before == after:
            assert seen + rest == uninterrupted[0]
        assert [_ids(b) for b in resumed] == uninterrupted[1]


@pytest.mark.usefixtures("sigint_default")
def test_loop_interrupted_by_ctrl_c_continues_exactly_and_leaves_nothing(tree):
    src, cache = tree
    shm_before = set(os.listdir("/dev/shm"))
    received = threading.Event()

    def interrupt():
        received.wait(30)
        os.kill(os.getpid(), signal.SIGINT)

    with _loader(src, cache, 2, batch_size=2, prefetch_factor=2) as loader:
        loader.dataset.delay = 0.05
        got = []
        sender = threading.Thread(target=interrupt)
        sender.start()
        interrupted = False
        try:
            for batch in loader:
                # The loop's first act keeps the batch: a C call, after which the
                # interpreter looks for signals only once the batch is kept.
                got.append(batch)
                received.set()
            time.sleep(10)  # the signal is on its way
        except KeyboardInterrupt:
            interrupted = True
        sender.join()
        seen = [i for b in got for i in _ids(b)]
        assert interrupted and len(seen) < 40
        rest = [i for b in loader for i in _ids(b)]
        assert sorted(seen + rest) == list(range(40))
    leftovers = [n for _, _, names in os.walk(cache) for n in names if n.startswith(TMP_PREFIX)]
    assert leftovers == []
    assert {
        e for e in set(os.listdir("/dev/shm")) - shm_before if not e.startswith("sem.")
    } == set()


@pytest.mark.usefixtures("sigint_default")
@pytest.mark.parametrize("where", ["_record", "_record_batch"])
def test_ctrl_c_while_a_batch_is_marked_received_serves_it_again(tree, where):
    # A real SIGINT, with Python's own handler, raised at the moment the loader
    # marks the third batch received: the batch never reached the loop, so the
    # next iteration serves it; every sample is seen exactly once.
    src, cache = tree
    marks = 0

    def trace(frame, event, arg):
        nonlocal marks
        if event == "call" and frame.f_code.co_name == where:
            marks += 1
            if marks == 3:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)  # the handler raises here
        return None

    with _loader(src, cache, 2, batch_size=2) as loader:
        got = []
        sys.settrace(trace)
        try:
            with pytest.raises(KeyboardInterrupt):
                for batch in loader:
                    got.append(batch)
        finally:
            sys.settrace(None)
        seen = [i for b in got for i in _ids(b)]
        assert len(seen) == 4  # two batches reached the loop; the third was being marked
        assert loader.state_dict()["datasets"][0]["prefix"] <= 4
        rest = [i for b in loader for i in _ids(b)]
        assert sorted(seen + rest) == list(range(40))


def test_drop_last_finishes_the_epoch(tree):
    src, cache = tree
    with _loader(src, cache, 2, batch_size=7, drop_last=True) as loader:
        first = [i for b in loader for i in _ids(b)]
        assert len(first) == 2 * (20 // 7) * 7  # each worker drops its own partial batch
        assert loader.state_dict()["datasets"][0]["prefix"] == 40
        assert len([i for b in loader for i in _ids(b)]) == len(first)  # a whole new epoch


def test_forwarding_wrapper_and_missing_state(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    loader = DataLoader(Forwarding(files), batch_size=5, num_workers=0)
    assert loader.state_dict()["dataset"]["prefix"] == 0
    loader.load_state_dict({"version": 1, "dataset": {**files.state_dict(), "prefix": 38}})
    assert [i for b in loader for i in b.tolist()] == [
        index_of(p) for p in VolumeDataset(src, cache_dir=cache)
    ][38:]

    class Plain(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(DataError, match="no position to save"):
        DataLoader(Plain(), num_workers=0).state_dict()


def test_ranks_planned_for_other_worker_counts_are_rejected(tmp_path):
    make_tree(tmp_path / "src", 4)
    files = VolumeDataset(tmp_path / "src", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="state"):
        DataLoader(files, num_workers=0).load_state_dict({"nope": 1})


class _Checked(IterableDataset):
    """Reads each cached path at once and checks its content."""

    def __init__(self, files):
        self.files = files

    def __iter__(self):
        for path in self.files:
            with open(path, "rb") as fh:
                yield index_of(path), fh.read() == content(index_of(path), 1 << 20)


@pytest.mark.root
def test_workers_share_a_small_cache_filesystem(tmp_path, small_tmpfs):
    make_tree(tmp_path / "src", 80, size=1 << 20)  # 80 MB through a 30 MB tmpfs, two workers
    files = VolumeDataset(tmp_path / "src", cache_dir=small_tmpfs / "cache", prefetch=3)
    threshold = int(0.1 * shutil.disk_usage(small_tmpfs).total)
    with DataLoader(_Checked(files), batch_size=4, num_workers=2, collate_fn=list) as loader:
        got = [item for batch in loader for item in batch]
    assert sorted(i for i, _ in got) == list(range(80))
    assert all(ok for _, ok in got)
    assert shutil.disk_usage(small_tmpfs).free >= threshold
