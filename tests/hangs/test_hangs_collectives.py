"""Which collective each rank is in: the ask over the channel, and the words for it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from nbtools import events
from nbtools._hangs import _collectives
from nbtools._hangs._collectives import Position
from nbtools.events import _ask


def _at(enqueued: int, completed: int, op: str = "all_reduce", size: int | None = None):
    return [Position("0", enqueued, completed, op, enqueued, size)]


def test_the_words_about_collectives_name_the_one_in_flight_and_who_never_entered_it():
    answers = {0: _at(1812, 1811), 2: _at(1812, 1811), 3: _at(1812, 1811), 1: _at(1811, 1811)}
    (line,) = _collectives.describe(answers, culprits=[1], world_size=4)
    assert line == (
        "ranks 0, 2, 3 wait in all_reduce #1812, which rank 1 never entered "
        "(last entered: rank 1: #1811)"
    )
    assert _collectives.culprits_of(answers) == [1]  # never a rank that only waits
    del answers[1]  # stopped: it cannot answer
    (line,) = _collectives.describe(answers, culprits=[1], world_size=4)
    assert line.startswith("ranks 0, 2, 3 wait in all_reduce #1812, rank 1 could not answer")
    assert _collectives.culprits_of(answers) is None  # the record alone cannot tell
    # Every rank done with its last collective: nothing in flight, nothing to say.
    assert _collectives.describe({0: _at(5, 5), 1: _at(5, 5)}, culprits=[1], world_size=2) == []


def test_ranks_in_different_collectives_at_the_same_number_are_named_as_a_mismatch():
    answers = {0: _at(68, 67, "all_reduce", 4096), 1: _at(68, 67, "broadcast", 4096)}
    (line,) = _collectives.describe(answers, culprits=[0, 1], world_size=2)
    assert (
        line
        == "rank 0 is in all_reduce #68 (4 KB), rank 1 in broadcast #68: a mismatched collective"
    )
    assert _collectives.culprits_of(answers) == [0, 1]
    # The same op with different sizes is a mismatch too; the same op and size is a wait.
    sizes = {0: _at(68, 67, "all_reduce", 4096), 1: _at(68, 67, "all_reduce", 8192)}
    assert "a mismatched collective" in _collectives.describe(sizes, [0, 1], 2)[0]
    same = {0: _at(68, 67, "all_reduce", 4096), 1: _at(68, 67, "all_reduce", 4096)}
    assert _collectives.describe(same, [0, 1], 2) == ["ranks 0, 1 wait in all_reduce #68"]
    assert _collectives.culprits_of(same) is None


def test_the_kernel_asks_ranks_elsewhere_through_the_askers_launchers_add():
    calls = []

    def asker():
        calls.append("ray")
        return 3  # three ranks asked

    def broken():
        raise RuntimeError("the cluster is gone")

    events.add_collectives_asker(broken)
    events.add_collectives_asker(asker)
    try:
        with _ask.ask() as request:
            assert request.asked >= 3  # a failing asker does not silence the others
        assert calls == ["ray"]
    finally:
        events.remove_collectives_asker(asker)
        events.remove_collectives_asker(broken)
    events.remove_collectives_asker(asker)  # harmless twice
    with _ask.ask():
        pass
    assert calls == ["ray"]


@pytest.mark.slow
def test_a_rank_answers_the_ask_with_its_collectives_as_the_reply_not_on_the_bus(tmp_path):
    torch = pytest.importorskip("torch")
    del torch
    code = """
        import os, sys, time
        import torch, torch.distributed as dist
        from nbtools import events
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
        dist.all_reduce(torch.ones(1024))
        events.step(1)                       # the flusher thread starts
        print("ready", flush=True)
        time.sleep(60)
    """
    bus = events.Bus()
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), RANK="0")
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(tmp_path / "store")],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(0.5)
            answers = _collectives.ask({0}, {0: proc.pid})
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    (position,) = answers[0]
    assert position.op == "all_reduce" and position.enqueued == position.completed >= 1
    assert position.size == 4096  # 1024 floats
    # The answer went to the ask that waited for it, not to the bus's subscribers.
    assert bus.log(kinds=[_ask.KIND]) == [] and bus.log(kinds=["progress"])
