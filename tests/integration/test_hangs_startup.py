"""The start-up bound a run learns carries to its next attempt and to a pool's next call.

Before its first step a rank has three times the slowest first step its run showed
(3 minutes before it showed any). A restarted group, or a pool's next call, starts
with what the earlier attempts learned: a deadlock before the first step of attempt
2 is named by that bound, not by the 3 minutes of a run that showed nothing.
"""

from __future__ import annotations

import threading

import pytest

from nbtools import DistributedError, distributed, events
from nbtools._hangs import Watchdog
from nbtools._hangs._watchdog import STARTUP_S
from nbtools.launch import RankPool

pytestmark = pytest.mark.slow


@pytest.fixture
def hangs():
    """Every hang event published while the test runs."""
    seen: list[events.Event] = []
    lock = threading.Lock()

    def keep(batch):
        with lock:
            seen.extend(e for e in batch if e.kind == "hang" and not e.fields.get("ended"))

    events.subscribe(keep)
    yield seen
    events.unsubscribe(keep)


def test_a_restarted_group_s_first_step_has_the_start_up_bound_its_first_attempt_learned(hangs):
    @distributed(processes=2, hang_timeout=2, on_hang="restart", max_restarts=1)
    def train(steps):
        import threading
        import time

        import torch
        import torch.distributed as dist

        from nbtools.runtime import get_restart_count

        rank = dist.get_rank()
        if get_restart_count() == 1 and rank == 1:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire(timeout=150)  # a deadlock before the restarted group's first step
        t = torch.ones(4)
        for step in range(steps):
            time.sleep(0.05)
            dist.all_reduce(t)
            events.step(step)
            if get_restart_count() == 0 and rank == 1 and step == 5:
                raise RuntimeError("a failure that restarts the group")
        return step

    with pytest.raises(DistributedError):
        train.distributed(20)
    assert [e.rank for e in hangs] == [1], [e.message for e in hangs]
    (hang,) = hangs
    assert hang.fields.get("step") is None  # before its first step
    assert hang.fields["bound_s"] < STARTUP_S  # learned in attempt 1, not the default
    assert hang.fields["entered"] is False  # rank 0 waits in the all-reduce rank 1 never entered


def test_a_pool_s_next_call_has_the_start_up_bound_its_earlier_calls_learned(hangs):
    with RankPool(processes=2, hang_timeout=2, on_hang="restart", output="none") as pool:
        pool.execute("import threading, time\nimport torch\nimport torch.distributed as dist")
        pool.execute(
            "from nbtools import events\n"
            "for step in range(10):\n"
            "    time.sleep(0.05)\n"
            "    dist.all_reduce(torch.ones(1))\n"
            "    events.step(step)\n"
        )
        with pytest.raises(DistributedError) as info:
            pool.execute(
                "from nbtools import events\n"
                "if dist.get_rank() == 1:\n"
                "    lock = threading.Lock()\n"
                "    lock.acquire()\n"
                "    lock.acquire(timeout=150)  # a deadlock before the call's first step\n"
                "dist.all_reduce(torch.ones(1))\n"
                "events.step(0)\n"
            )
        assert "rank 1" in str(info.value), info.value
    assert [e.rank for e in hangs] == [1], [e.message for e in hangs]
    assert hangs[0].fields["bound_s"] < STARTUP_S  # learned in the earlier call


def test_watchdogs_sharing_first_steps_start_from_the_bound_learned_before():
    from nbtools._hangs import FirstSteps

    first_steps = FirstSteps()
    first = Watchdog(2, first_steps=first_steps)
    assert first.startup_bound() == STARTUP_S  # nothing learned yet
    first_steps.add(20.0)
    again = Watchdog(2, first_steps=first_steps)
    assert again.startup_bound() == 60.0  # three times the slowest first step seen
    assert Watchdog(2).startup_bound() == STARTUP_S  # a run of its own learned nothing
