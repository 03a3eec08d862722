"""``@distributed(heal=True, on_hang="restart")``: the hung rank is ended and healed in place."""

from __future__ import annotations

import os
import time

import pytest

from nbtools import distributed, events

pytestmark = pytest.mark.slow


def _stalls_once(work: str) -> tuple[int, int]:
    import signal
    import time

    import torch
    import torch.distributed as dist

    from nbtools import events as rank_events
    from nbtools import runtime

    rank, attempt = dist.get_rank(), runtime.get_restart_count()
    with open(os.path.join(work, f"pid-{attempt}-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    for step in range(60):
        time.sleep(0.05)
        # Late enough that its progress reports (shipped about once a second) arrived.
        if rank == 1 and step == 40 and attempt == 0:
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped: its peers wait in the collective
        dist.all_reduce(torch.ones(1))
        rank_events.step(step)
    return os.getpid(), attempt


def test_a_hung_rank_is_ended_and_replaced_while_the_others_keep_their_processes(tmp_path):
    since = time.time()
    job = distributed(
        processes=3, max_restarts=2, heal=True, on_hang="restart", hang_timeout=3, output="none"
    )(_stalls_once)
    results = job.distributed(str(tmp_path))
    first = {r: int((tmp_path / f"pid-0-{r}").read_text()) for r in range(3)}
    assert [attempt for _, attempt in results] == [1, 1, 1]
    assert results[0][0] == first[0] and results[2][0] == first[2]
    assert results[1][0] != first[1]
    hangs = [e for e in events.log(since=since, kinds=["hang"]) if not e.fields.get("ended")]
    assert [e.rank for e in hangs] == [1]
    healed = events.log(since=since, kinds=["healed"])
    assert [e.fields["ranks"] for e in healed] == ["1"], healed
    assert not events.log(since=since, kinds=["restart"])
