"""Positions in an epoch, independent of world size and number of workers.

An epoch is a permutation ``order`` of the dataset's file indices; a *position*
is an index into ``order``. The files consumed so far in an epoch are a set of
positions, kept in the compact form :class:`Consumed`: every position below
``prefix`` plus a short sorted list ``extras`` above it. Because the slots of a
global stride advance almost in step, ``extras`` stays as small as a few
batches per slot, however large the dataset is.

An iteration splits the positions not yet consumed over ``stride`` slots (one
slot per rank and loader worker): slot ``s`` takes, in order, the unconsumed
positions ``i`` with ``i % stride == s``. With nothing consumed this is the
plain global stride ``order[s::stride]``; resuming with the same stride gives
every slot exactly the positions an uninterrupted run would have given it.

A loader with a global batch splits them another way (:class:`BatchLayout`):
the positions not consumed, in order, are cut into global batches, and each
rank takes its share of every batch, so that all ranks take the same number of
steps and a resumed run at any world size takes the same batches.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Consumed",
    "Order",
    "epoch_order",
    "slot_chunks",
    "slot_positions",
    "slot_length",
    "advance",
    "BatchLayout",
    "ordinal_positions",
    "batch_chunks",
    "batch_advance",
]


@dataclass(frozen=True)
class Consumed:
    """The positions consumed in one epoch: all of ``[0, prefix)`` plus ``extras``.

    Invariant: ``extras`` is sorted, unique, and every entry is ``> prefix``
    (position ``prefix`` itself is never consumed, else the prefix would be longer).
    """

    prefix: int = 0
    extras: tuple[int, ...] = field(default_factory=tuple)

    def count(self) -> int:
        """How many positions are consumed."""
        return self.prefix + len(self.extras)

    def contains(self, position: int) -> bool:
        """True when ``position`` was consumed."""
        if position < self.prefix:
            return True
        i = bisect.bisect_left(self.extras, position)
        return i < len(self.extras) and self.extras[i] == position

    def is_complete(self, num_files: int) -> bool:
        """True when every position of an epoch of ``num_files`` files is consumed."""
        return self.prefix >= num_files

    @classmethod
    def from_positions(cls, prefix: int, positions: set[int]) -> Consumed:
        """Canonical form of ``[0, prefix)`` united with ``positions``."""
        while prefix in positions:
            prefix += 1
        return cls(prefix, tuple(sorted(p for p in positions if p > prefix)))


#: Rounds of the Feistel network that shuffles an epoch (4 make a pseudo-random
#: permutation of a Feistel network with random round functions; 8 give margin
#: for a cheap multiplicative round).
_ROUNDS = 8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection mod 2**64


class Order:
    """The file indices of one epoch in serving order, computed per position.

    A deterministic function of ``(seed, epoch)``: every rank, worker and
    resumed run computes the same order without communicating. Shuffled, the
    order is a keyed pseudo-random permutation: a Feistel network over the
    smallest power of two covering the files (halves of unequal size when its
    bit count is odd; each round adds the top bits of a keyed multiplicative
    hash of one half to the other), walked again from any result that falls
    outside the files (cycle walking; the domain is under twice the files, so
    under two steps per position on average). Any position maps to its file in
    O(1) time and no process holds an array over the whole dataset.

    Args:
        num_files: Files in the dataset.
        seed: Seed of the shuffle.
        epoch: The epoch.
        shuffle: False for the listing's order.
    """

    __slots__ = ("num_files", "_keys", "_bits")

    def __init__(self, num_files: int, seed: int, epoch: int, shuffle: bool) -> None:
        self.num_files = int(num_files)
        self._keys: list[np.uint64] | None = None
        self._bits = (0, 0)
        if shuffle and self.num_files > 1:
            bits = max(2, (self.num_files - 1).bit_length())
            self._bits = (bits - bits // 2, bits // 2)  # the halves: left, right
            rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF, 0x6E62])
            self._keys = list(rng.integers(0, 1 << 63, size=_ROUNDS, dtype=np.uint64))

    def _permute(self, x: np.ndarray) -> np.ndarray:
        a, b = self._bits  # sizes in bits of the left and right halves
        left, right = x >> np.uint64(b), x & np.uint64((1 << b) - 1)
        for key in self._keys:  # type: ignore[union-attr]
            # (left: a bits, right: b bits) -> (right, left + F(right) mod 2**a): a bijection.
            hashed = ((right ^ key) * _GOLDEN) >> np.uint64(64 - a)
            left, right = right, (left + hashed) & np.uint64((1 << a) - 1)
            a, b = b, a
        return (left << np.uint64(b)) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The file index (int64) at each of ``positions`` (ints in ``[0, num_files)``)."""
        if self._keys is None:
            return np.asarray(positions, dtype=np.int64)
        out = self._permute(np.asarray(positions, dtype=np.uint64))
        limit = np.uint64(self.num_files)
        outside = np.flatnonzero(out >= limit)
        while len(outside):  # cycle walking
            walked = self._permute(out[outside])
            out[outside] = walked
            outside = outside[walked >= limit]
        return out.astype(np.int64)


def epoch_order(num_files: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The file indices of ``epoch`` in the order they are served (all of them; for tests)."""
    return Order(num_files, seed, epoch, shuffle).at(np.arange(num_files))


def _residue_extras(consumed: Consumed, stride: int, slot: int) -> list[int]:
    return [e for e in consumed.extras if e % stride == slot]


def _first_candidate(prefix: int, stride: int, slot: int) -> int:
    return prefix + ((slot - prefix) % stride)


def slot_positions(consumed: Consumed, num_files: int, stride: int, slot: int) -> Iterator[int]:
    """Positions that slot ``slot`` of ``stride`` slots serves, in order."""
    for chunk in slot_chunks(consumed, num_files, stride, slot):
        yield from chunk.tolist()


def slot_chunks(
    consumed: Consumed, num_files: int, stride: int, slot: int, first: int = 64, most: int = 1024
) -> Iterator[np.ndarray]:
    """:func:`slot_positions` as int64 arrays of ``first`` positions, growing to ``most``."""
    skip = np.array(_residue_extras(consumed, stride, slot), dtype=np.int64)
    position = _first_candidate(consumed.prefix, stride, slot)
    size = first
    while position < num_files:
        end = min(num_files, position + size * stride)
        chunk = np.arange(position, end, stride, dtype=np.int64)
        position = int(chunk[-1]) + stride
        if len(skip):
            chunk = chunk[~np.isin(chunk, skip)]
        if len(chunk):
            yield chunk
        size = min(most, size * 4)


def slot_length(consumed: Consumed, num_files: int, stride: int, slot: int) -> int:
    """Number of positions :func:`slot_positions` yields, computed in O(len(extras))."""
    first = _first_candidate(consumed.prefix, stride, slot)
    candidates = max(0, -(-(num_files - first) // stride))
    skipped = sum(1 for e in _residue_extras(consumed, stride, slot) if e < num_files)
    return candidates - skipped


def _nth_position(consumed: Consumed, stride: int, slot: int, n: int) -> int:
    """The ``n``-th (1-based) position of the slot; O(len(extras))."""
    first = _first_candidate(consumed.prefix, stride, slot)
    skipped = _residue_extras(consumed, stride, slot)
    position = first + (n - 1) * stride
    # Each skipped position at or before the candidate pushes it one stride on.
    for extra in skipped:
        if extra <= position:
            position += stride
        else:
            break
    return position


def advance(consumed: Consumed, num_files: int, stride: int, counts: Mapping[int, int]) -> Consumed:
    """``consumed`` plus the first ``counts[slot]`` positions of each slot.

    The cost depends on the number of slots and on how far apart they are, not
    on the dataset size.
    """
    if stride < 1:
        raise ValueError(f"stride must be at least 1, got {stride}")
    ends: dict[int, int] = {}
    gaps: list[int] = []
    for slot in range(stride):
        length = slot_length(consumed, num_files, stride, slot)
        n = min(max(int(counts.get(slot, 0)), 0), length)
        if n > 0:
            ends[slot] = _nth_position(consumed, stride, slot, n)
        # The first position of the slot not consumed after this step.
        gaps.append(_nth_position(consumed, stride, slot, n + 1) if n < length else num_files)
    for slot in counts:
        if not 0 <= slot < stride:
            raise ValueError(f"slot {slot} is outside a stride of {stride}")
    prefix = min(gaps, default=num_files)
    if prefix >= num_files:
        return Consumed(num_files, ())
    # Below ``prefix`` every position is consumed; above it only the old extras
    # and each slot's run from ``prefix`` up to its last served position.
    extras = {e for e in consumed.extras if e > prefix}
    for slot, end in ends.items():
        extras.update(range(_first_candidate(prefix, stride, slot), end + 1, stride))
    return Consumed(prefix, tuple(sorted(extras)))


# --- global batches ---------------------------------------------------------------------


@dataclass(frozen=True)
class BatchLayout:
    """Slots that serve whole global batches: the same batches at any world size.

    The positions not consumed, taken in order, are cut into global batches of
    ``sum(shares)`` (the *ordinals* ``k * G .. (k + 1) * G - 1`` make step
    ``k``). Within a step, rank ``r`` takes the ``shares[r]`` ordinals after
    those of lower ranks; step ``k`` comes from loader worker ``k %
    num_workers`` of every rank, which is how a loader takes batches from its
    workers. Slot ``r * num_workers + j`` serves rank ``r``'s part of the
    steps of worker ``j``. The ``R`` positions left after the last whole step
    make one smaller step split the same way (shares of ``R`` that differ by at
    most one), or are skipped with ``drop_last``.

    Whole steps consume a prefix of the ordinals, so what is left after any
    number of steps is cut the same way whatever the world size: a run that
    resumes with other shares serves the same global batches, in the same
    order, as one that never stopped.
    """

    shares: tuple[int, ...]
    num_workers: int
    drop_last: bool = False

    @property
    def global_batch(self) -> int:
        """Positions per step, all ranks together."""
        return sum(self.shares)

    @property
    def stride(self) -> int:
        """Number of slots over all ranks and workers."""
        return len(self.shares) * self.num_workers

    def last_shares(self, remaining: int) -> tuple[int, ...]:
        """Each rank's part of the smaller last step of ``remaining`` positions (none: zeros)."""
        world = len(self.shares)
        rest = 0 if self.drop_last else remaining % self.global_batch
        base, extra = divmod(rest, world)
        return tuple(base + (1 if r < extra else 0) for r in range(world))

    def _step(self, remaining: int, slot: int, t: int) -> tuple[int, int]:
        """``(first ordinal, length)`` of the ``t``-th step slot ``slot`` serves; length 0: none."""
        rank, worker = divmod(slot, self.num_workers)
        g = self.global_batch
        k = worker + t * self.num_workers
        whole = remaining // g
        if k < whole:
            return k * g + sum(self.shares[:rank]), self.shares[rank]
        if k == whole:
            last = self.last_shares(remaining)
            return k * g + sum(last[:rank]), last[rank]
        return 0, 0

    def slot_length(self, remaining: int, slot: int) -> int:
        """Positions slot ``slot`` serves out of ``remaining``."""
        rank, worker = divmod(slot, self.num_workers)
        whole = remaining // self.global_batch
        steps = max(0, -(-(whole - worker) // self.num_workers))
        tail = self.last_shares(remaining)[rank] if whole % self.num_workers == worker else 0
        return steps * self.shares[rank] + tail

    def ordinal_after(self, remaining: int, slot: int, served: int) -> int | None:
        """The ordinal slot ``slot`` serves after its first ``served``; None when it has no more."""
        share = self.shares[slot // self.num_workers]
        t, within = divmod(served, share)
        start, length = self._step(remaining, slot, t)
        return start + within if within < length else None

    def served_above(self, remaining: int, slot: int, served: int, floor: int) -> np.ndarray:
        """The ordinals above ``floor`` among the first ``served`` of slot ``slot``.

        Only the steps from the one holding ``floor`` on are looked at.
        """
        rank, worker = divmod(slot, self.num_workers)
        share = self.shares[rank]
        first = max(0, (floor // self.global_batch - worker) // self.num_workers)
        parts = [np.zeros(0, dtype=np.int64)]
        for t in range(first, -(-served // share)):
            start, length = self._step(remaining, slot, t)
            ordinals = np.arange(start, start + min(length, served - t * share), dtype=np.int64)
            parts.append(ordinals[ordinals > floor])
        return np.concatenate(parts)

    def slot_ordinals(self, remaining: int, slot: int, most: int) -> Iterator[np.ndarray]:
        """The ordinals of slot ``slot``, in order, as int64 arrays of about ``most`` at most."""
        share = max(1, self.shares[slot // self.num_workers])
        per_chunk = max(1, most // share)
        t = 0
        while True:
            steps = [self._step(remaining, slot, t + i) for i in range(per_chunk)]
            parts = [np.arange(s, s + n, dtype=np.int64) for s, n in steps if n]
            if parts:
                yield np.concatenate(parts)
            if len(parts) < per_chunk:
                return
            t += per_chunk


def ordinal_positions(consumed: Consumed, ordinals: np.ndarray) -> np.ndarray:
    """The positions of the ``ordinals``-th positions (0-based) not in ``consumed``."""
    extras = np.asarray(consumed.extras, dtype=np.int64)
    # Free positions below each extra: the n-th free position passes every extra with
    # fewer than n + 1 free positions below it.
    below = extras - consumed.prefix - np.arange(len(extras), dtype=np.int64)
    ordinals = np.asarray(ordinals, dtype=np.int64)
    return consumed.prefix + ordinals + np.searchsorted(below, ordinals, side="right")


def batch_chunks(
    consumed: Consumed, num_files: int, layout: BatchLayout, slot: int, most: int = 4096
) -> Iterator[np.ndarray]:
    """The positions slot ``slot`` of ``layout`` serves, in order, as int64 arrays."""
    remaining = num_files - consumed.count()
    for ordinals in layout.slot_ordinals(remaining, slot, most):
        yield ordinal_positions(consumed, ordinals)


def batch_advance(
    consumed: Consumed, num_files: int, layout: BatchLayout, counts: Mapping[int, int]
) -> Consumed:
    """``consumed`` plus the first ``counts[slot]`` positions each slot of ``layout`` serves.

    After whole steps this is a longer prefix of the ordinals; only the slots
    that stopped part-way through a step (or ahead of the others) leave extras.
    """
    remaining = num_files - consumed.count()
    for slot in counts:
        if not 0 <= slot < layout.stride:
            raise ValueError(f"slot {slot} is outside a stride of {layout.stride}")
    served = {
        slot: min(max(int(counts.get(slot, 0)), 0), layout.slot_length(remaining, slot))
        for slot in range(layout.stride)
    }
    nexts = [layout.ordinal_after(remaining, s, n) for s, n in served.items()]
    pending = [o for o in nexts if o is not None]
    if not pending:  # every slot served all it has (a dropped remainder counts as consumed)
        return Consumed(num_files, ())
    first_free = min(pending)  # every ordinal below it is served
    taken = [layout.served_above(remaining, slot, n, first_free) for slot, n in served.items()]
    above = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    prefix = int(ordinal_positions(consumed, np.array([first_free]))[0])
    extras = {e for e in consumed.extras if e > prefix}
    extras.update(ordinal_positions(consumed, above).tolist())
    return Consumed.from_positions(prefix, extras)
