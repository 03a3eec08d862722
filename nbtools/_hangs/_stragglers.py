"""Straggler scores: the share of time each rank spends outside collectives.

In synchronous data parallelism every rank's step takes as long as the
slowest's, so step times say nothing about who is slow. What differs is the
share of time each rank spends outside collectives: a straggler is almost
never waiting, the others wait for it. A GPU rank, whose wait is a spin that
its sampled state reads as work, reports that share itself, from the start
and end times in NCCL's Flight Recorder (``events._recorder``). The watchdog samples each local rank's
training thread (:mod:`._process`) and counts the samples in one-second bins;
:class:`Stragglers` keeps a rolling window of those bins per rank, scores each
rank as the (lower) median share over the ranks divided by its own, and opens
a flag when a score stays under the threshold for ``confirm_s`` (and ends it
when it stays back over it for as long). A rank on another node samples
itself and sends its counts with its progress reports (``events._probe``);
ranks that sent none (an older rank) are scored by their step rate instead.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from nbtools._hangs._flags import FlagBook
from nbtools._hangs._report import clock_text
from nbtools._hangs._state import Flag, RankState, lower_median, sampled

__all__ = ["Stragglers"]


class Stragglers:
    """Scores the ranks of one group and opens or ends their straggler flags.

    Args:
        book: Where the flags, the cell's lines and the events go.
        threshold: Scores under this are flagged.
        window_s: Seconds of samples a score covers.
        confirm_s: How long a score must stay under (or back over) the threshold.
        sample_s: Period of the samples counted in the bins.
    """

    def __init__(
        self, book: FlagBook, threshold: float, window_s: float, confirm_s: float, sample_s: float
    ) -> None:
        self._book = book
        self.threshold = threshold
        self.window_s = window_s
        self.confirm_s = confirm_s
        self.sample_s = sample_s

    def bin(
        self, ranks: Iterable[RankState], now: float, flowing: bool, paused_from: float | None
    ) -> None:
        """Close this second's samples into each rank's window (or drop them: a pause).

        Args:
            ranks: The ranks known.
            now: The kernel's time.
            flowing: Some rank made progress lately (else the samples are left out).
            paused_from: In a pause (a save, a restore): since when; samples from then
                on are dropped. None: no pause.
        """
        for state in ranks:
            if flowing and paused_from is None and (state.working or state.waiting):
                state.bins.append((now, state.working, state.waiting))
            state.working = state.waiting = 0
            if paused_from is not None:  # samples from just before the pause's event go too
                while state.bins and state.bins[-1][0] >= paused_from:
                    state.bins.pop()
            while state.bins and state.bins[0][0] < now - self.window_s:
                state.bins.popleft()

    def judge(self, ranks: dict[int, RankState], now: float, device: bool = True) -> None:
        """Score every rank that can be scored; open or end flags (none while a hang is open).

        A GPU rank is scored by the share outside NCCL's collectives it reported from
        its Flight Recorder (its wait is a spin that its sampled state reads as work),
        when ``device`` (not right after a pause); other ranks by their samples.
        """
        if any(kind == "hang" for kind, _ in self._book.open) or len(ranks) < 2:
            return
        shares = {}
        for state in ranks.values():
            if state.device_outside is not None:
                if device:
                    shares[state.rank] = state.device_outside
                continue
            total = sum(w + x for _, w, x in state.bins)
            if sampled(state) and total * self.sample_s >= self.window_s / 2:
                shares[state.rank] = sum(w for _, w, _ in state.bins) / total
        scores: dict[int, float] = {}
        measured: dict[int, str] = {}
        if len(shares) >= 2:
            reference = lower_median(list(shares.values()))
            for rank, share in shares.items():
                scores[rank] = reference / share if share > 0 else 1.0
                measured[rank] = (
                    f"{share:.0%} of its time outside collectives against the median "
                    f"rank's {reference:.0%}"
                )
        rates = {
            s.rank: 1.0 / statistics.median(s.step_times)
            for s in ranks.values()
            if not sampled(s)
            and s.device_outside is None
            and len(s.step_times) >= 5
            and statistics.median(s.step_times) > 0
        }
        if len(rates) >= 2:
            reference = lower_median(list(rates.values()))
            for rank, rate in rates.items():
                scores[rank] = rate / reference
                measured[rank] = (
                    f"{rate:.3g} steps/s against the median rank's {reference:.3g} steps/s"
                )
        for rank, score in scores.items():
            self._score(ranks[rank], min(score, 9.99), now, measured[rank])

    def _score(self, state: RankState, score: float, now: float, measured: str) -> None:
        """Open or end ``state``'s straggler flag by its ``score``; ``measured`` says what the
        score compares (time outside collectives, or step rates for a rank on another node)."""
        state.score = score
        key = ("straggler", state.rank)
        flags = self._book.open
        flag = flags.get(key)
        if score < self.threshold:
            state.high_since = None
            state.low_since = state.low_since or now
            if flag is None and now - state.low_since >= self.confirm_s:
                flag = Flag("straggler", state.rank, state.host, state.low_since, score)
                flags[key] = flag
                since = self._book.epoch(flag.since)
                message = (
                    f"rank {state.rank} on {state.host} is a straggler since "
                    f"{clock_text(since)}: {measured} (score {score:.2f}, flagged under "
                    f"{self.threshold:.2f})"
                )
                self._book.notice(
                    "straggler",
                    message,
                    rank=state.rank,
                    node=state.host,
                    since=round(since, 3),
                    score=round(score, 3),
                    step=state.step,
                )
            elif flag is not None:
                flag.score = min(flag.score or score, score)
            return
        state.low_since = None
        if flag is not None and score >= min(1.0, self.threshold + 0.05):
            state.high_since = state.high_since or now
            if now - state.high_since >= self.confirm_s:
                del flags[key]
                self._book.end(flag, now, f"{measured}: score {score:.2f}")
