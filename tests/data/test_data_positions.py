"""Positions in an epoch: slot splits, counts and resume with any stride."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from nbtools.data._positions import (
    Consumed,
    Order,
    advance,
    epoch_order,
    slot_length,
    slot_positions,
)


def test_fresh_epoch_is_the_global_stride():
    n, stride = 23, 4
    for slot in range(stride):
        assert list(slot_positions(Consumed(), n, stride, slot)) == list(range(n))[slot::stride]


def test_same_stride_resume_serves_exactly_the_rest_of_each_slot():
    n, stride = 50, 3
    counts = {0: 7, 1: 5, 2: 6}
    consumed = advance(Consumed(), n, stride, counts)
    for slot in range(stride):
        rest = list(slot_positions(consumed, n, stride, slot))
        assert rest == list(range(n))[slot::stride][counts[slot] :]


def test_random_chains_of_resumes_with_changing_strides_serve_each_position_once():
    rng = random.Random(7)
    for _ in range(1500):
        n = rng.randint(0, 70)
        consumed, seen = Consumed(), set()
        for _ in range(rng.randint(1, 5)):
            stride = rng.randint(1, 8)
            seqs = {s: list(slot_positions(consumed, n, stride, s)) for s in range(stride)}
            assert sorted(p for seq in seqs.values() for p in seq) == sorted(set(range(n)) - seen)
            for s in range(stride):
                assert slot_length(consumed, n, stride, s) == len(seqs[s])
            counts = {
                s: rng.randint(0, len(seqs[s]) + 2) for s in range(stride) if rng.random() < 0.8
            }
            for s, k in counts.items():
                seen.update(seqs[s][:k])
            consumed = advance(consumed, n, stride, counts)
            assert {p for p in range(n) if consumed.contains(p)} == seen
            assert consumed.count() == len(seen)
            assert consumed.is_complete(n) == (len(seen) == n)


def test_extras_stay_small_when_slots_advance_in_step():
    n, stride = 1_000_000, 16
    counts = {s: 40_000 + (s % 4) * 64 for s in range(stride)}
    consumed = advance(Consumed(), n, stride, counts)
    assert consumed.prefix == 40_000 * stride
    assert len(consumed.extras) <= stride * 3 * 64


def test_order_is_a_deterministic_permutation_of_seed_and_epoch():
    a = epoch_order(100, seed=3, epoch=1, shuffle=True)
    assert sorted(a.tolist()) == list(range(100))
    assert a.tolist() == epoch_order(100, seed=3, epoch=1, shuffle=True).tolist()
    assert a.tolist() != epoch_order(100, seed=3, epoch=2, shuffle=True).tolist()
    assert a.tolist() != epoch_order(100, seed=4, epoch=1, shuffle=True).tolist()
    assert epoch_order(5, 0, 9, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_bad_slot_is_rejected():
    with pytest.raises(ValueError, match="outside a stride"):
        advance(Consumed(), 10, 2, {5: 1})


def test_a_shuffled_position_maps_to_its_file_without_an_array_over_the_epoch():
    n = 10_000_000_000  # ten billion files: 80 GB as an array of indices
    tracemalloc.start()
    try:
        order = Order(n, seed=1, epoch=2, shuffle=True)
        got = order.at(np.array([0, 1, 2, n - 1], dtype=np.int64))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert len(set(got.tolist())) == 4 and all(0 <= i < n for i in got.tolist())
    assert got.tolist() == order.at(np.array([0, 1, 2, n - 1])).tolist()
    small = Order(1000, seed=1, epoch=2, shuffle=True)
    pieces = np.concatenate([small.at(np.arange(a, a + 100)) for a in range(0, 1000, 100)])
    assert pieces.tolist() == epoch_order(1000, 1, 2, True).tolist()
    assert sorted(pieces.tolist()) == list(range(1000))
    # Spread over the epoch: neighbouring positions are not neighbouring files.
    assert np.abs(np.diff(pieces)).mean() > 200
