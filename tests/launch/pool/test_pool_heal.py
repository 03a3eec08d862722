"""A pool whose rank dies heals in place: the other ranks keep their processes and names."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nbtools import distributed, events
from nbtools.errors import DistributedError, PoolError
from nbtools.launch import RankPool

pytestmark = pytest.mark.slow

_SETUP = (
    "import os\nimport torch\nimport torch.distributed as dist\n"
    "w = torch.full((2,), float(dist.get_rank()))\nlr = 0.1"
)
_SUM = "t = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())"


def _since() -> float:
    """Now: events from here on are this test's (the last one logged may share its time)."""
    return time.time()


def test_a_rank_killed_between_calls_is_replaced_and_the_others_keep_their_names():
    since = _since()
    with RankPool(processes=3, max_restarts=2, output="none") as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(DistributedError) as info:
            pool.execute("1")
        message = str(info.value)
        assert message.startswith("rank 1 died (SIGKILL); healed in "), message
        assert "ranks 0, 2 kept their processes and names, rank 1 replaced" in message
        assert "the names lost there (its namespace is new): lr, w" in message
        assert info.value.failures[1].exitcode == -signal.SIGKILL
        after = pool.pids
        assert after[0] == pids[0] and after[2] == pids[2] and after[1] != pids[1]
        assert pool.restarts == 1
        # Survivors kept their names; the replacement starts empty, in the same group.
        assert pool.execute("'w' in globals() and 'lr' in globals()") == [True, False, True]
        assert pool.execute("import torch\nimport torch.distributed as dist\n" + _SUM) == [3] * 3
        assert pool.execute("float(w[0]) if 'w' in globals() else None") == [0.0, None, 2.0]
    healed = events.log(since=since, kinds=["healed"])
    assert [e.fields["ranks"] for e in healed] == ["1"]
    assert healed[0].fields["kept"] == "0,2" and healed[0].fields["lost"] == "lr,w"
    assert not events.log(since=since, kinds=["pool_restarted"])


def test_two_ranks_killed_at_once_are_replaced_in_one_heal():
    with RankPool(processes=3, output="none") as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[2], signal.SIGKILL)
        with pytest.raises(DistributedError) as info:
            pool.execute("1")
        message = str(info.value)
        assert message.startswith("rank 1 died (SIGKILL) and rank 2 died (SIGKILL); healed in")
        assert "rank 0 kept its process and names, ranks 1, 2 replaced" in message, message
        assert "(their namespaces are new): lr, w" in message, message
        assert pool.pids[0] == pids[0] and not {pids[1], pids[2]} & set(pool.pids)
        assert pool.restarts == 1
        assert pool.execute("'w' in globals()") == [True, False, False]


def test_a_rank_killed_in_a_collective_heals_and_the_budget_holds():
    with RankPool(processes=2, max_restarts=1, output="none") as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        with pytest.raises(DistributedError, match=r"rank 0 died \(SIGKILL\); healed in"):
            pool.execute("if dist.get_rank() == 0:\n    os.kill(os.getpid(), 9)\n" + _SUM)
        assert pool.pids[1] == pids[1] and pool.pids[0] != pids[0]
        assert pool.execute("globals().get('lr')") == [None, 0.1]
        pool.execute(_SETUP)
        assert pool.execute(_SUM) == [2, 2]
        # max_restarts=1 is used up by the heal: the next death stops the pool.
        with pytest.raises(DistributedError, match=r"stopped .*max_restarts=1"):
            pool.execute("os.kill(os.getpid(), 9)")
        with pytest.raises(PoolError, match="restart"):
            pool.execute("1")


def test_a_survivor_busy_outside_any_collective_is_interrupted_and_keeps_its_names():
    with RankPool(processes=2, output="none") as pool:
        pool.execute(_SETUP + "\nimport time")
        pids = pool.pids
        with pytest.raises(DistributedError, match=r"rank 1 died \(SIGKILL\); healed in"):
            pool.execute("if dist.get_rank() == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(600)")
        assert pool.pids[0] == pids[0] and pool.restarts == 1
        assert pool.execute("'w' in globals()") == [True, False]


def test_a_rank_that_raises_keeps_every_process_and_heals_nothing():
    since = _since()
    with RankPool(processes=2, output="none") as pool:
        pool.execute(_SETUP)
        pids = pool.pids
        with pytest.raises(DistributedError, match="ValueError: boom"):
            pool.execute("raise ValueError('boom')")
        assert pool.pids == pids and pool.restarts == 0
    assert not events.log(since=since, kinds=["healed"])


def test_on_hang_restart_ends_the_hung_rank_and_heals_it_in_place():
    since = _since()
    with RankPool(processes=3, hang_timeout=3, on_hang="restart", output="none") as pool:
        pool.execute(_SETUP + "\nimport time, signal\nfrom nbtools import events")
        pids = pool.pids
        with pytest.raises(DistributedError) as info:
            pool.execute(
                "for step in range(1000):\n"
                "    time.sleep(0.05)\n"
                "    if dist.get_rank() == 1 and step == 10:\n"
                "        os.kill(os.getpid(), signal.SIGSTOP)  # stopped: its peers wait\n"
                "    dist.all_reduce(torch.ones(1))\n"
                "    events.step(step)\n"
            )
        message = str(info.value)
        assert "rank 1 was ended (SIGKILL); healed in" in message, message
        assert "ranks 0, 2 kept their processes and names, rank 1 replaced" in message, message
        after = pool.pids
        assert after[0] == pids[0] and after[2] == pids[2] and after[1] != pids[1]
        assert pool.restarts == 1
        assert pool.execute("'w' in globals()") == [True, False, True]
    hangs = [e.rank for e in events.log(since=since, kinds=["hang"]) if not e.fields.get("ended")]
    assert hangs == [1]
    assert [e.fields["ranks"] for e in events.log(since=since, kinds=["healed"])] == ["1"]


def test_a_kept_pool_heals_a_killed_rank_and_runs_the_call_again(tmp_path):
    @distributed(processes=2, keep_alive=True, max_restarts=1, output="none")
    def step(kill: str) -> int:
        import os
        import signal

        import torch.distributed as dist

        if dist.get_rank() == 1 and os.path.exists(kill):
            os.unlink(kill)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
        return os.getpid()

    kill = tmp_path / "kill"
    since = _since()
    try:
        first = step.distributed(str(kill))
        kill.touch()
        again = step.distributed(str(kill))
    finally:
        distributed.shutdown()
    assert again[0] == first[0] and again[1] != first[1]
    assert [e.fields["ranks"] for e in events.log(since=since, kinds=["healed"])] == ["1"]
    assert [e.fields["attempt"] for e in events.log(since=since, kinds=["restart"])] == [1]


def test_distributed_start_no_heal_restarts_every_rank(ip):
    ip.run_line_magic("distributed", "start --processes 2 --output none --no-heal")
    ip.run_cell_magic("distributed", "", "x = 1")
    pool = ip.magics_manager.registry["DistributedMagics"].pool
    pids = pool.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(DistributedError, match="restarted with 2 fresh ranks"):
        ip.run_cell_magic("distributed", "", "x")
    assert set(pool.pids).isdisjoint(pids)
