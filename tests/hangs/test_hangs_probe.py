"""Ranks the kernel cannot look at (on another node) are judged by what they see of themselves.

The ranks here are real processes in a real gloo group on this machine, but each names
another node (``NBTOOLS_NODE``), as Ray's ranks do when the kernel runs on another host:
the watchdog does not read their ``/proc``. Each rank samples its own training thread
(``events._probe``) and its progress reports carry what it saw; the kernel scores
stragglers and tells busy from stuck from that alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nbtools import events
from nbtools._hangs import Watchdog
from nbtools.events import _probe
from nbtools.launch._ray._backend import look_at_process

pytestmark = pytest.mark.slow

_RANK = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from nbtools import events
    from nbtools._internal import hooks
    hooks.rank_started()  # what the launcher's rank set-up runs
    dist.init_process_group(
        "gloo", init_method=f"file://{sys.argv[1]}", rank=int(os.environ["RANK"]), world_size=2
    )
    rank, mode, steps = dist.get_rank(), sys.argv[2], int(sys.argv[3])
    t = torch.ones(4)
    for step in range(steps):
        time.sleep(0.2 if mode == "slow" and rank == 1 else 0.05)
        if mode == "busy" and rank == 0 and step == 10:  # rank 0 alone evaluates, at full CPU
            end = time.monotonic() + 14
            while time.monotonic() < end:
                torch.randn(256, 256) @ torch.randn(256, 256)
        if mode == "gil-stuck" and rank == 0 and step == 40:
            import ctypes  # libc's sleep through PyDLL: blocked, and holding the GIL
            ctypes.PyDLL(None).sleep(20)
        if mode == "gil-busy" and rank == 0 and step == 40:
            import re  # a match that backtracks for many seconds in C, holding the GIL
            re.match(r"(a+)+$", "a" * 29 + "b")
        dist.all_reduce(t)
        events.step(step)
    events.emit("rank_done")  # the watch ends here, as a launcher's ends with its group
    events.flush()
    dist.destroy_process_group()
    """
)


def _run(
    tmp_path, mode: str, steps: int, dog_args: dict, look: bool = False
) -> tuple[Watchdog, list, list[str]]:
    """Two ranks naming another node, watched by a kernel that cannot read their processes;
    ``look``: but that has them looked at from their node when their reports stop, as the
    Ray launcher does (here the node is this machine, and the look runs in the kernel)."""
    bus = events.Bus()
    reports: list = []
    notices: list[str] = []
    with events.Collector(bus=bus) as collector:
        env = dict(os.environ, **collector.environment(), **{events.NODE_ENV: "another-node"})
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(tmp_path / "store"), mode, str(steps)],
                env=dict(env, RANK=str(rank)),
            )
            for rank in (0, 1)
        ]
        if look:
            dog_args["look"] = lambda rank, tid: look_at_process(procs[rank].pid, tid)
        dog = Watchdog(2, on_hang=reports.append, bus=bus, **dog_args).start()
        try:
            deadline = time.monotonic() + 120
            while len(bus.log(kinds=["rank_done"])) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            notices += dog.take_notices()
        finally:
            dog.stop()
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                finally:
                    proc.kill()
                    proc.wait()
    assert [p.returncode for p in procs] == [0, 0]
    return dog, reports, notices


def test_a_rank_on_another_node_evaluating_while_its_peer_waits_is_a_long_phase(tmp_path):
    dog, reports, notices = _run(tmp_path, "busy", 20, {"hang_timeout": 6.0})
    assert not dog._ranks[0].local and dog._ranks[0].probed_at  # judged by its own look
    assert reports == []  # its peer waits for it; it computes: no hang
    (line,) = [n for n in notices if "long phase" in n]
    assert line.startswith("rank 0 on another-node is in a long phase outside collectives")


def test_a_slow_rank_on_another_node_is_a_straggler_by_its_own_samples(tmp_path, monkeypatch):
    # In lockstep every rank steps at the pace of the slowest: only the time each spends
    # outside the all-reduce, which the ranks sample themselves, tells the slow one.
    monkeypatch.setenv("NBTOOLS_STRAGGLER_WINDOW_S", "6")
    monkeypatch.setenv("NBTOOLS_STRAGGLER_CONFIRM_S", "2")
    dog, reports, notices = _run(tmp_path, "slow", 70, {})
    assert reports == []
    flagged = [n for n in notices if "is a straggler" in n]
    assert flagged and all(n.startswith("rank 1 on another-node") for n in flagged), notices
    assert "of its time outside collectives" in flagged[0]


def test_a_rank_s_probe_reads_its_training_thread_and_its_tree(tmp_path):
    probe = _probe.Probe(0).start()  # this process's main thread: this test, running
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            sum(i * i for i in range(10_000))
            fields = probe.take()
            if fields["working"] and fields.get("state") == "working":
                break
            time.sleep(0.3)
    finally:
        probe.stop()
    assert fields["working"] > 0 and fields["state"] == "working"
    assert fields["tree_cpu"] > 0 and fields["tree_io"] >= 0


def test_a_thread_blocked_on_a_lock_waits_whatever_the_probe_learned_of_the_gil():
    # The probe learns where threads wait for the interpreter lock (a wait that is work to
    # do); a thread blocked on any other lock is still waiting.
    gil = _probe.gil_range(0.3)
    assert gil is None or gil[1] - gil[0] < 1 << 16  # a few addresses, not all memory
    lock = threading.Lock()
    lock.acquire()
    tids: list[int] = []

    def blocked():
        tids.append(threading.get_native_id())
        lock.acquire(timeout=20)

    thread = threading.Thread(target=blocked)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if tids and _probe.sample(os.getpid(), tids[0], gil) == ("waiting", "futex"):
                break
            time.sleep(0.05)
        assert tids and _probe.sample(os.getpid(), tids[0], gil) == ("waiting", "futex")
    finally:
        lock.release()
        thread.join(10)


# A training thread that holds the GIL starves the rank's probe thread: the rank falls
# silent, busy or stuck. Looked at from its node, it is told apart again.


def test_a_rank_on_another_node_stuck_holding_the_gil_is_named_a_hang(tmp_path):
    dog, reports, notices = _run(tmp_path, "gil-stuck", 60, {"hang_timeout": 6.0}, look=True)
    assert [r.ranks for r in reports] == [(0,)], [r.headline for r in reports]
    assert "blocked in clock_nanosleep, outside any collective" in reports[0].headline
    assert not [n for n in notices if "long phase" in n], notices


def test_a_rank_on_another_node_busy_holding_the_gil_is_a_long_phase(tmp_path):
    dog, reports, notices = _run(tmp_path, "gil-busy", 60, {"hang_timeout": 6.0}, look=True)
    assert dog._ranks[0].looked_at  # its probe was silent: it was looked at from its node
    assert reports == [], [r.headline for r in reports]
    (line,) = [n for n in notices if "long phase" in n]
    assert line.startswith("rank 0 on another-node is in a long phase outside collectives")


def test_without_a_look_from_its_node_a_rank_busy_holding_the_gil_is_not_told_from_stuck(
    tmp_path,
):
    # What the kernel can say of a silent rank it cannot see: it could not answer.
    dog, reports, notices = _run(tmp_path, "gil-busy", 60, {"hang_timeout": 6.0})
    assert [r.ranks for r in reports] == [(0,)], [r.headline for r in reports]
    assert "could not answer" in reports[0].headline
