"""Global batches over the positions of an epoch: the same batches at any world size."""

from __future__ import annotations

import random

import numpy as np
import pytest
from _data_helpers import Indices

from nbtools.data import DataLoader, VolumeDataset
from nbtools.data._positions import (
    BatchLayout,
    Consumed,
    advance,
    batch_advance,
    batch_chunks,
    ordinal_positions,
    slot_positions,
)
from nbtools.data.dataset import _check_shares
from nbtools.errors import DataError
from nbtools.runtime import batch_plan


def _layout(global_batch: int, world: int, workers: int, drop_last: bool = False) -> BatchLayout:
    return BatchLayout(batch_plan(global_batch, world, 0).shares, workers, drop_last)


def _slots(consumed: Consumed, n: int, layout: BatchLayout) -> dict[int, list[int]]:
    return {
        s: [p for c in batch_chunks(consumed, n, layout, s, most=5) for p in c.tolist()]
        for s in range(layout.stride)
    }


def _steps(consumed: Consumed, n: int, layout: BatchLayout) -> list[list[int]]:
    """The global steps as a loader delivers them: step k from worker k % num_workers."""
    seqs = _slots(consumed, n, layout)
    world, workers = len(layout.shares), layout.num_workers
    steps: list[list[int]] = []
    taken = dict.fromkeys(seqs, 0)
    k = 0
    while any(taken[s] < len(seqs[s]) for s in seqs):
        j = k % workers
        step: list[int] = []
        for r in range(world):
            s = r * workers + j
            share = layout.shares[r]
            part = seqs[s][taken[s] : taken[s] + share]
            taken[s] += len(part)
            step += part
        steps.append(step)
        k += 1
    return steps


def test_ordinal_positions_skip_what_was_consumed():
    consumed = Consumed.from_positions(3, {5, 6, 9})
    free = [p for p in range(20) if not consumed.contains(p)]
    assert ordinal_positions(consumed, np.arange(len(free))).tolist() == free


@pytest.mark.parametrize(
    ("n", "g", "world", "workers"), [(40, 7, 4, 1), (40, 7, 3, 2), (100, 13, 5, 3)]
)
def test_steps_are_consecutive_global_batches_split_by_the_batch_plan(n, g, world, workers):
    layout = _layout(g, world, workers)
    steps = _steps(Consumed(), n, layout)
    assert [p for step in steps for p in step] == list(range(n))  # in order, each once
    assert [len(s) for s in steps] == [g] * (n // g) + ([n % g] if n % g else [])
    for s in range(layout.stride):
        assert layout.slot_length(n, s) == len(_slots(Consumed(), n, layout)[s])


def test_drop_last_skips_the_smaller_last_step_and_still_ends_the_epoch():
    layout = _layout(7, 3, 2, drop_last=True)
    steps = _steps(Consumed(), 40, layout)
    assert [len(s) for s in steps] == [7] * 5
    counts = {s: layout.slot_length(40, s) for s in range(layout.stride)}
    assert batch_advance(Consumed(), 40, layout, counts).is_complete(40)


def test_resume_after_whole_steps_at_another_world_size_serves_the_same_global_batches():
    n, g = 103, 13
    reference = _steps(Consumed(), n, _layout(g, 8, 1))
    consumed, got = Consumed(), []
    for world, workers, steps in ((8, 1, 3), (5, 2, 2), (8, 3, 10)):
        layout = _layout(g, world, workers)
        delivered = _steps(consumed, n, layout)[:steps]
        got += delivered
        # What each slot's stream handed out for those steps.
        counts: dict[int, int] = {}
        for k in range(len(delivered)):
            for r in range(world):
                slot = r * workers + k % workers
                counts[slot] = counts.get(slot, 0) + layout.shares[r]
        consumed = batch_advance(consumed, n, layout, counts)
        assert consumed.extras == () and consumed.prefix == sum(len(s) for s in got)
    assert [sorted(s) for s in got] == [sorted(s) for s in reference]


def test_random_chains_of_resumes_with_any_layout_serve_each_position_once():
    rng = random.Random(11)
    for _ in range(400):
        n = rng.randint(0, 90)
        consumed, seen = Consumed(), set()
        for _ in range(rng.randint(1, 5)):
            if rng.random() < 0.25:  # a stride-split iteration in between
                stride = rng.randint(1, 6)
                seqs = {s: list(slot_positions(consumed, n, stride, s)) for s in range(stride)}
                counts = {s: rng.randint(0, len(q) + 1) for s, q in seqs.items()}
                consumed_next = advance(consumed, n, stride, counts)
            else:
                world, workers = rng.randint(1, 6), rng.randint(1, 3)
                layout = _layout(rng.randint(world, 3 * world), world, workers, rng.random() < 0.3)
                seqs = _slots(consumed, n, layout)
                free = sorted(set(range(n)) - seen)
                served = sorted(p for q in seqs.values() for p in q)
                assert len(served) == len(set(served)) and set(served) <= set(free)
                if not layout.drop_last:
                    assert served == free
                counts = {s: rng.randint(0, len(q) + 1) for s, q in seqs.items()}
                consumed_next = batch_advance(consumed, n, layout, counts)
                if all(counts[s] >= len(q) for s, q in seqs.items()):
                    seen.update(free)  # the epoch is over: a dropped remainder counts
                    counts = {}
            for s, k in counts.items():
                seen.update(seqs[s][:k])
            consumed = consumed_next
            assert {p for p in range(n) if consumed.contains(p)} == seen
            assert consumed.count() == len(seen)


def test_loader_sizes_its_batches_from_the_plan_and_scales_the_last_step(tree):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=2)
    with DataLoader(Indices(files), global_batch_size=7, num_workers=0) as loader:
        assert loader.batch_size == 7 and loader.batch_plan.shares == (7,)
        scales = []
        sizes = []
        for batch in loader:
            sizes.append(len(batch))
            scales.append(loader.loss_scale)
        assert sizes == [7] * 5 + [5]
        assert scales == [1 / 7] * 5 + [1 / 5]
    files = VolumeDataset(src, cache_dir=cache, shuffle=True, seed=2)
    with DataLoader(Indices(files), global_batch_size=7, drop_last=True, num_workers=2) as loader:
        assert [len(b) for b in loader] == [7] * 5
        assert loader.state_dict()["datasets"][0]["prefix"] == 40  # the epoch is over
        assert [len(b) for b in loader] == [7] * 5  # and the next one is whole again


def test_loader_refuses_a_global_batch_it_cannot_split(tree, monkeypatch):
    src, cache = tree
    files = VolumeDataset(src, cache_dir=cache)
    with pytest.raises(ValueError, match="not both"):
        DataLoader(files, batch_size=4, global_batch_size=8, num_workers=0)
    with pytest.raises(DataError, match="needs a VolumeDataset"):
        DataLoader(list(range(10)), global_batch_size=8, num_workers=0)
    with pytest.raises(ValueError, match="cannot be split over 9 ranks"):
        monkeypatch.setenv("WORLD_SIZE", "9")
        DataLoader(files, global_batch_size=8, num_workers=0)
    # Built for three ranks (as a launcher's environment says) but iterated in a world of one.
    monkeypatch.setenv("WORLD_SIZE", "3")
    with (
        DataLoader(files, global_batch_size=8, num_workers=0) as loader,
        pytest.raises(DataError, match="over 3 ranks, but the process group now has 1"),
    ):
        iter(loader)


def test_an_epoch_whose_last_step_leaves_a_rank_without_a_sample_is_refused_at_its_start():
    with pytest.raises(DataError, match="ends with 3 samples .* fewer than the 4 ranks"):
        _check_shares((2, 2, 2, 2), 4, 43, drop_last=False)
    _check_shares((2, 2, 2, 2), 4, 43, drop_last=True)
    _check_shares((2, 2, 2, 2), 4, 44, drop_last=False)
