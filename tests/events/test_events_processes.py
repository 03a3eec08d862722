"""Real processes send events to the kernel through a real named pipe.

Each test starts a ``Collector`` with a bus of its own, gives the children its
environment as the launcher does, and reads the bus after the children exit.
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest

from nbtools import events
from nbtools.events import Bus, Collector

_FORK = mp.get_context("fork")


@pytest.fixture
def collector():
    c = Collector(bus=Bus()).start()
    yield c
    c.stop()


def _run_python(code: str, collector: Collector, timeout: int = 240, **env: str) -> str:
    full_env = dict(os.environ, **collector.environment(), **env)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _by_kind(bus: Bus) -> dict[str, list[events.Event]]:
    groups: dict[str, list[events.Event]] = collections.defaultdict(list)
    for event in bus.log():
        groups[event.kind].append(event)
    return groups


# --- forked children -----------------------------------------------------------


def _emit_steps(kind: str, n: int) -> None:
    for i in range(n):
        events.emit(kind, message=f"{kind} {i}", step=i, pid_seen=os.getpid())


def _grandchild(n: int) -> None:
    _emit_steps("grandchild", n)  # no flush: the multiprocessing exit sends the rest


def _child(n: int) -> None:
    # Events still buffered (and a flusher running) when this process forks: the
    # grandchild must not send them a second time.
    _emit_steps("child", n)
    proc = _FORK.Process(target=_grandchild, args=(n,))
    proc.start()
    proc.join()
    _emit_steps("child_after", n)
    if proc.exitcode != 0:
        raise SystemExit(f"grandchild exited with {proc.exitcode}")


def test_forked_child_and_its_forked_child_deliver_everything_once(collector, monkeypatch):
    for name, value in collector.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "5")
    n = 300
    proc = _FORK.Process(target=_child, args=(n,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    collector.drain()
    groups = _by_kind(collector.bus)
    for kind in ("child", "grandchild", "child_after"):
        got = groups[kind]
        assert [e.step for e in got] == list(range(n)), kind
        assert len({e.pid for e in got}) == 1 and all(e.rank == 5 for e in got)
        assert all(e.fields["pid_seen"] == e.pid for e in got), "stamped with its own pid"
    assert groups["child"][0].pid == groups["child_after"][0].pid == proc.pid
    assert groups["grandchild"][0].pid != proc.pid
    assert collector.bus.dropped() == 0


# --- fresh interpreters --------------------------------------------------------


def test_a_fresh_interpreter_delivers_everything_at_a_normal_exit(collector):
    n = 5000
    _run_python(
        f"""
        from nbtools import events
        for i in range({n}):
            events.emit("fresh", message="m" * 40, step=i)
        """,
        collector,
        RANK="1",
    )
    collector.drain()
    got = collector.bus.log(kinds=["fresh"])
    assert [e.step for e in got] == list(range(n))
    assert {e.rank for e in got} == {1}
    assert collector.bus.dropped() == 0


@pytest.mark.slow
def test_loader_workers_with_a_dataset_defined_in_main_deliver(collector):
    # As in a notebook: the dataset class lives in __main__, torch forks the workers.
    _run_python(
        """
        import torch
        from torch.utils.data import DataLoader, Dataset
        from nbtools import events

        class Cell(Dataset):
            def __len__(self):
                return 40
            def __getitem__(self, i):
                info = torch.utils.data.get_worker_info()
                events.emit("item", index=i, worker=info.id)
                return i

        events.emit("rank_started")
        seen = sorted(int(x) for x in DataLoader(Cell(), num_workers=2, batch_size=None))
        assert seen == list(range(40))
        events.emit("rank_done")
        """,
        collector,
        RANK="0",
    )
    collector.drain()
    groups = _by_kind(collector.bus)
    assert sorted(e.fields["index"] for e in groups["item"]) == list(range(40))
    assert {e.fields["worker"] for e in groups["item"]} == {0, 1}
    assert len({e.pid for e in groups["item"]}) == 2
    assert len(groups["rank_started"]) == len(groups["rank_done"]) == 1


def test_a_million_emits_in_a_tight_loop_neither_block_nor_grow(collector):
    delivered = [0]

    def count(batch):
        delivered[0] += len(batch)

    collector.bus.subscribe(count)
    out = _run_python(
        """
        import json, resource
        from nbtools import events
        events.emit("warm")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for i in range(1_000_000):
            events.emit("flood", step=i, loss=0.5)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"grown_kib": after - before}))
        """,
        collector,
        timeout=280,
        RANK="0",
    )
    collector.drain()
    grown_kib = json.loads(out.strip().splitlines()[-1])["grown_kib"]
    # Kept in memory, a million events take several hundred MiB; the buffer holds 10,000.
    assert grown_kib < 64 * 1024
    dropped = collector.bus.dropped()
    assert delivered[0] + dropped == 1_000_001, "every event is delivered or counted as dropped"
    if dropped:
        (source,) = collector.bus.dropped_by_source()
        assert source[1] == 0, "the kernel knows which rank dropped them"
    # The kernel keeps working: a later process still gets through.
    _run_python('from nbtools import events\nevents.emit("after_flood")\n', collector)
    collector.drain()
    assert len(collector.bus.log(kinds=["after_flood"])) == 1


def test_a_process_whose_collector_is_gone_exits_without_blocking(tmp_path):
    collector = Collector(tmp_path, bus=Bus()).start()
    env = collector.environment()
    collector.stop()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from nbtools import events\nfor i in range(20000): events.emit('x')\nprint('done')",
        ],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


def test_an_explicit_flush_delivers_before_the_process_ends(collector):
    # A rank's last act: flush, then report; the kernel sees the events before the exit.
    code = """
        import sys
        from nbtools import events
        for i in range(1000):
            events.emit("before_flush", step=i)
        assert events.flush(timeout=30)
        print("flushed", flush=True)
        sys.stdin.readline()
        """
    env = dict(os.environ, **collector.environment())
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "flushed"
        collector.drain()
        assert [e.step for e in collector.bus.log(kinds=["before_flush"])] == list(range(1000))
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0


# --- bad input on the pipe -------------------------------------------------------


def test_malformed_events_from_a_process_are_left_out_and_later_events_still_arrive(collector):
    # Another process writes batches by hand: a time that is a string, a null time,
    # a batch mixing good and bad entries; then it emits normally. One bad entry must
    # cost only itself: the bus keeps working for everything after it.
    seen: list[events.Event] = []
    collector.bus.subscribe(seen.extend)
    _run_python(
        """
        import json, os, time
        from nbtools import events

        path = os.environ["NBTOOLS_EVENTS_CHANNEL"].partition(":")[2]
        now = time.time()
        def batch(*entries):
            head = {"v": 1, "h": "forger", "p": os.getpid(), "r": 0, "d": 0, "e": list(entries)}
            return (json.dumps(head) + "\\n").encode()
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, batch(["soon", 0, "bad_time", None, 1, {}]))
        os.write(fd, batch([None, 0, "null_time", None, 2, {}]))
        os.write(fd, batch([now, 0, "good_in_mixed", None, 3, {}],
                           [now, "zero", "bad_rank", None, 4, {}],
                           [now, 0, "bad_fields", None, 5, {"x": [1, 2]}],
                           [float("nan"), 0, "nan_time", None, 6, {}],
                           [now, 0, "", None, 7, {}],
                           "not an entry"))
        os.close(fd)
        for i in range(3):
            events.emit("after", message=f"after {i}", step=i)
        """,
        collector,
        RANK="0",
    )
    collector.drain()
    log = collector.bus.log()  # raised TypeError once a string time was kept
    kinds = [e.kind for e in log]
    assert kinds.count("after") == 3, "events after the bad ones are delivered"
    assert "good_in_mixed" in kinds, "a valid entry next to invalid ones is kept"
    assert not {"bad_time", "null_time", "bad_rank", "bad_fields", "nan_time"} & set(kinds)
    assert collector.bus.rejected() == 7
    assert [e.step for e in seen if e.kind == "after"] == [0, 1, 2], "subscribers see them too"
    assert collector.bus.malformed() == 0, "the batches themselves were readable"
