"""What a run trained on, step by step, from the lines its model wrote at each forward."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["check_same_batches", "effective", "per_epoch"]


def effective(log_dir: Path, rank: int, restored: int | None) -> list[list[int]]:
    """The sample ids of each step the final weights went through on ``rank``.

    The killed attempt's first ``restored`` steps, then every step of the next one.
    """
    lines = [json.loads(x) for x in (log_dir / f"rank{rank}.jsonl").read_text().splitlines()]
    first = [r["ids"] for r in lines if r["attempt"] == 0]
    second = [r["ids"] for r in lines if r["attempt"] == 1]
    return first[: restored or 0] + second if second else first


def per_epoch(steps: list[list[int]], steps_per_epoch: int) -> list[list[int]]:
    """The ids seen in each epoch, in order."""
    return [
        sorted(i for s in steps[e : e + steps_per_epoch] for i in s)
        for e in range(0, len(steps), steps_per_epoch)
    ]


def check_same_batches(tmp_path: Path, world: int, start: int, steps_per_epoch: int, epochs: int):
    """The recovered run (``tmp_path/recovered``, resumed at ``start``) trained on the
    batches of the reference run (``tmp_path/reference``) on every rank, and on every
    sample once per epoch."""
    logs = [effective(tmp_path / "recovered" / "log", rank, start) for rank in range(world)]
    for rank, mine in enumerate(logs):
        assert mine == effective(tmp_path / "reference" / "log", rank, None)
        assert len(mine) == steps_per_epoch * epochs
    epochs_seen = zip(*(per_epoch(mine, steps_per_epoch) for mine in logs), strict=True)
    seen = [sorted(i for ids in ranks for i in ids) for ranks in epochs_seen]
    samples = steps_per_epoch * world * len(logs[0][0])
    assert seen == [list(range(samples))] * epochs
