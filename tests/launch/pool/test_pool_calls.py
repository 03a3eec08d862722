"""RankPool with real CPU ranks: state between calls, execute / push / pull / run, errors."""

from __future__ import annotations

import fractions
import sys
import threading

import pytest

from nbtools import events
from nbtools._internal import hooks
from nbtools.errors import DistributedError, PicklingError, PoolError
from nbtools.launch import RankPool

# Every test here talks to a pool of real rank processes.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with RankPool(processes=2) as pool:
        yield pool


def test_state_stays_on_the_ranks_between_calls(pool):
    pool.execute(
        "import torch\nimport torch.distributed as dist\nw = torch.ones(2) * (dist.get_rank() + 1)"
    )
    pids = pool.pids
    assert pool.execute("w.sum().item()") == [2.0, 4.0]
    assert pool.execute("dist.all_reduce(w)\nw.tolist()") == [[3.0, 3.0], [3.0, 3.0]]
    assert pool.pull("w")[1].tolist() == [3.0, 3.0]
    assert pool.pids == pids


def test_execute_returns_the_last_expression_or_none(pool):
    assert pool.execute("a = 5") == [None, None]
    assert pool.execute("a * 2") == [10, 10]
    with pytest.raises(SyntaxError):
        pool.execute("def broken(:")


def test_push_then_pull_and_run_sees_the_rank_namespace(pool):
    pool.push(lr=0.5, steps=3)
    pool.push({"name": "run-1"})
    assert pool.pull("lr", "name") == ([0.5, 0.5], ["run-1", "run-1"])

    def scaled(factor):
        import torch.distributed as dist

        return dist.get_rank(), factor * 2

    assert pool.run(scaled, 3) == [(0, 6), (1, 6)]


def test_pool_calls_run_the_launch_integrations_of_the_libraries_they_use(pool, monkeypatch):
    # The kernel-side hook a plain call runs before its ranks start (MLflow's: create a
    # new local store once) runs before a pool call whose code uses the library, and
    # only then: a function from a cell, a cell's code, pushed values.
    calls = []
    monkeypatch.setattr(sys.modules[__name__], "_probe", lambda: calls.append(1), raising=False)
    monkeypatch.setitem(
        hooks._REGISTRY,
        "fractions",
        hooks.Integration("fractions", before_launch=f"{__name__}:_probe"),
    )
    namespace = {"__name__": "__main__"}
    exec("def half(x):\n    import fractions\n    return str(fractions.Fraction(x, 2))", namespace)
    assert pool.run(namespace["half"], 3) == ["3/2", "3/2"]
    assert len(calls) == 1
    assert pool.execute("1 + 1") == [2, 2]
    assert len(calls) == 1
    pool.execute("import fractions")
    pool.push(third=fractions.Fraction(1, 3))
    assert len(calls) == 3
    assert pool.execute("str(third)") == ["1/3", "1/3"]


def test_a_function_from_a_notebook_cell_sees_rank_names_as_globals(pool):
    # The module of a notebook cell's function is __main__; that is what counts.
    def step():
        global counter
        counter = globals().get("counter", 0) + lr  # noqa: F821 - lr lives on the ranks
        return counter

    step.__module__ = "__main__"
    pool.push(lr=0.25)
    assert pool.run(step) == [0.25, 0.25]
    assert pool.run(step) == [0.5, 0.5]
    assert pool.pull("counter") == [0.5, 0.5]


def test_an_exception_on_every_rank_keeps_the_pool_and_its_state(pool):
    pool.execute("kept = 41")
    pids = pool.pids
    with pytest.raises(DistributedError) as info:
        pool.execute("raise ValueError('bad value on ' + str(dist.get_rank()))")
    message = str(info.value)
    assert "ValueError: bad value on 0" in message and "rank 1 also failed" in message
    assert "raise ValueError" in message  # the remote traceback, with the cell's source line
    assert "the pool and its state were kept" in message
    assert set(info.value.failures) == {0, 1}
    assert pool.execute("kept + 1") == [42, 42]
    assert pool.pids == pids


def test_bad_input_is_one_clear_line(pool):
    with pytest.raises(NameError, match="'missing' is not defined on ranks 0, 1"):
        pool.pull("missing")
    with pytest.raises(PicklingError, match="'lock'.*cannot be sent to the ranks"):
        pool.push(lock=threading.Lock())
    pool.execute("import threading\nheld = threading.Lock()")
    with pytest.raises(
        PicklingError, match="rank 0: 'held' \\(lock\\) cannot be sent to the notebook"
    ):
        pool.pull("held")
    with pytest.raises(ValueError, match="not a Python name"):
        pool.push(**{"not a name": 1})
    with pytest.raises(TypeError):
        pool.execute(b"1")
    assert pool.execute("kept") == [41, 41]  # nothing was lost


def test_a_closed_pool_says_so():
    with RankPool(processes=1, output="none") as small:
        assert small.execute("1 + 1") == [2]
    with pytest.raises(PoolError, match="closed"):
        small.execute("1")
    small.close()  # idempotent


def test_restart_gives_fresh_ranks_and_emits_an_event():
    with RankPool(processes=2, output="none") as pool:
        pool.execute("x = 1")
        pids = pool.pids
        since = events.log()[-1].time if events.log() else 0.0
        pool.restart()
        assert set(pool.pids).isdisjoint(pids)
        with pytest.raises(NameError):
            pool.pull("x")
        assert any(e.kind == "pool_restarted" for e in events.log(since=since))


def _numbered_steps():
    from nbtools import events as rank_events

    for i in range(5):
        rank_events.step(i)


def _batches_only():
    import time

    from nbtools import events as rank_events

    for _ in range(30):
        rank_events.step(None)  # a loop over nbtools' loader reports so
    time.sleep(1.5)  # the rank's flusher ships its count about once a second


def _steps_counted(rank: int, at_least: int) -> int:
    """The newest step count rank ``rank`` reported, once it reached ``at_least`` (or
    after waiting 20 s for it)."""
    import time

    deadline = time.monotonic() + 20
    while True:
        counts = [e.fields["steps"] for e in events.log(kinds=["progress"]) if e.rank == rank]
        if (counts and counts[-1] >= at_least) or time.monotonic() > deadline:
            return counts[-1] if counts else 0
        time.sleep(0.1)


@pytest.mark.slow
def test_a_call_that_only_loops_over_batches_counts_them_after_numbered_steps(pool):
    pool.run(_numbered_steps)
    pool.run(_batches_only)
    before = _steps_counted(0, 35)
    pool.run(_numbered_steps)  # numbered steps again: the marks of the next call ...
    pool.run(_batches_only)  # ... still count, as this call reports no number
    assert _steps_counted(0, before + 35) >= before + 35
