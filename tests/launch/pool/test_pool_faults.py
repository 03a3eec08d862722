"""Pool faults with real ranks: deaths, stuck peers, interrupts; the user is told what was lost."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import pytest

from nbtools import events
from nbtools.errors import DistributedError, PoolError
from nbtools.launch import RankPool

_SETUP = "import os, time\nimport torch\nimport torch.distributed as dist\nx = 1"


class _Watch:
    """A stand-in for the notebook's stream that fires an event once a text appeared."""

    def __init__(self, stream, text: str) -> None:
        self.stream, self.text, self.seen = stream, text, threading.Event()
        self.buffer = ""

    def write(self, data: str) -> int:
        self.buffer += data
        if self.buffer.count(self.text) >= 2:
            self.seen.set()
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()


def _interrupt_when(watch: _Watch) -> threading.Thread:
    def interrupt():
        if watch.seen.wait(60):
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    return thread


def _since() -> float:
    log = events.log()
    return log[-1].time if log else 0.0


@pytest.mark.slow
def test_a_rank_that_dies_mid_collective_restarts_the_pool_and_says_so():
    with RankPool(processes=2, max_restarts=1, output="none", heal=False) as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        since = _since()
        with pytest.raises(DistributedError) as info:
            pool.execute("if dist.get_rank() == 1:\n    os._exit(3)\ndist.barrier()")
        message = str(info.value)
        assert "rank 1 failed: the process exited with code 3" in message
        assert "restarted with 2 fresh ranks" in message and "was lost" in message
        assert set(pool.pids).isdisjoint(pids)
        assert pool.execute("1 + 1") == [2, 2]
        assert any(e.kind == "pool_restarted" for e in events.log(since=since))

        # max_restarts=1 is used up: the next death stops the pool, and says how to go on.
        pool.execute(_SETUP)
        with pytest.raises(DistributedError, match=r"stopped .*max_restarts=1.*pool.restart\(\)"):
            pool.execute("os.kill(os.getpid(), 9)")
        with pytest.raises(PoolError, match="restart"):
            pool.execute("1")
        pool.restart()
        assert pool.execute("2") == [2, 2]


@pytest.mark.slow
def test_ranks_stuck_after_a_peer_failed_are_restarted_with_a_plain_message():
    with RankPool(processes=2, output="none") as pool:
        pool.execute(_SETUP)
        with pytest.raises(DistributedError) as info:
            pool.execute("if dist.get_rank() == 0:\n    raise ValueError('boom')\ndist.barrier()")
        message = str(info.value)
        assert "rank 0 failed: ValueError: boom" in message
        assert "rank 1 did not finish" in message and "rank state" in message and "lost" in message
        with pytest.raises(NameError):
            pool.pull("x")  # fresh ranks


@pytest.mark.slow
@pytest.mark.usefixtures("sigint_default")
def test_an_interrupt_stops_user_code_on_every_rank_and_keeps_the_pool(monkeypatch):
    with RankPool(processes=2) as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        out = _Watch(sys.stdout, "sleeping")
        monkeypatch.setattr(sys, "stdout", out)
        interrupter = _interrupt_when(out)
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.execute(
                    "print('sleeping', flush=True)\n"
                    "try:\n    time.sleep(600)\n"
                    "except KeyboardInterrupt:\n    print('interrupted here', flush=True)\n    raise"
                )
        finally:
            interrupter.join()
        assert (
            "[rank 0] interrupted here" in out.buffer and "[rank 1] interrupted here" in out.buffer
        )
        assert pool.pids == pids
        assert pool.pull("x") == [1, 1]


@pytest.mark.slow
@pytest.mark.usefixtures("sigint_default")
def test_an_interrupt_that_ranks_do_not_return_from_restarts_the_pool(monkeypatch, caplog):
    with RankPool(processes=2) as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        out = _Watch(sys.stdout, "waiting")
        monkeypatch.setattr(sys, "stdout", out)
        interrupter = _interrupt_when(out)
        try:
            with pytest.raises(KeyboardInterrupt):
                # Rank 0 returns at once; rank 1 stays in the barrier, which signals cannot end.
                pool.execute(
                    "print('waiting', flush=True)\n"
                    "if dist.get_rank() == 0:\n    time.sleep(600)\nelse:\n    dist.barrier()"
                )
        finally:
            interrupter.join()
        assert "did not stop" in caplog.text and "rank state" in caplog.text
        assert set(pool.pids).isdisjoint(pids)
        with pytest.raises(NameError):
            pool.pull("x")


@pytest.mark.slow
def test_on_hang_restart_replaces_hung_ranks_and_names_them(caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")
    since = _since()
    with RankPool(
        processes=2, hang_timeout=3, on_hang="restart", output="none", heal=False
    ) as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        with pytest.raises(DistributedError) as info:
            pool.execute(
                "import signal\n"
                "from nbtools import events\n"
                "for step in range(1000):\n"
                "    time.sleep(0.05)\n"
                "    if dist.get_rank() == 1 and step == 10:\n"
                "        os.kill(os.getpid(), signal.SIGSTOP)  # stopped: its peer waits\n"
                "    dist.all_reduce(torch.ones(1))\n"
                "    events.step(step)\n"
            )
        message = str(info.value)
        assert "rank 1" in message and "restarted with 2 fresh ranks" in message, message
        assert pool.restarts == 1 and set(pool.pids).isdisjoint(pids)
        assert pool.execute("1 + 1") == [2, 2]
    hangs = [e.rank for e in events.log(since=since, kinds=["hang"]) if not e.fields.get("ended")]
    assert hangs == [1]
    # The stacks show the executed code's lines, as a traceback would.
    (report,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hang:")]
    if "py-spy is not installed" not in report:
        assert 'File "<pool execute>", line 7, in <module>' in report, report
        assert "dist.all_reduce(torch.ones(1))" in report, report
