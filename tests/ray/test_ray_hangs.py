"""A hung Ray rank, flagged by the kernel: named by its Ray node, with the collective.

The test cluster's nodes share one machine and so one host name: each rank's
node label carries the start of its Ray node id, as the GPU pane's labels do.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from nbtools import distributed, events

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_a_stopped_ray_rank_is_named_by_its_node_and_the_collective_the_others_wait_in(
    ray_cluster, caplog
):
    caplog.set_level(logging.WARNING, logger="nbtools")
    seen: list[events.Event] = []
    lock = threading.Lock()

    def keep(batch):
        with lock:
            seen.extend(e for e in batch if e.kind == "hang")
        for event in batch:
            if event.kind == "hang" and not event.fields.get("ended"):
                os.kill(event.fields["rank_pid"], signal.SIGCONT)

    @distributed(processes=3, cluster="ray", nodes=3, hang_timeout=4)
    def train(steps):
        import os
        import signal
        import time

        import torch
        import torch.distributed as dist

        from nbtools import events

        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            if dist.get_rank() == 1 and step == 20:
                os.kill(os.getpid(), signal.SIGSTOP)  # mid-step, before the all-reduce
            dist.all_reduce(t)
            events.step(step)
        return os.environ.get("NBTOOLS_NODE"), os.environ["NBTOOLS_NODE_ID"]

    events.subscribe(keep)
    try:
        where = train.distributed(40)
    finally:
        events.unsubscribe(keep)
    labels = [label for label, _ in where]
    assert len({node_id for _, node_id in where}) == 3  # one rank per node
    opened = [e for e in seen if not e.fields.get("ended")]
    assert [e.rank for e in opened] == [1], opened  # the ranks waiting for it are not named
    node = opened[0].fields["node"]
    assert node == labels[1] and node not in (labels[0], labels[2]), (node, labels)
    assert where[1][1][:8] in node  # the Ray node, not the host name every node shares
    # The ranks' answers came back from the actors: the collective is named.
    assert (opened[0].fields["collective"] or "").startswith("all_reduce #"), opened[0].fields
    assert [e.rank for e in seen if e.fields.get("ended")] == [1]
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hang:")]
    assert len(warnings) == 1, warnings
    headline = warnings[0].split("\n", 1)[0]
    assert f"rank 1 on {node}" in headline and "wait in all_reduce #" in headline, headline


def test_a_ray_rank_three_times_slower_is_the_only_straggler(ray_cluster, monkeypatch):
    # The actors run the rank's function on a thread of their own: the kernel samples
    # that thread (its reports name it), as it samples a local rank's main thread.
    monkeypatch.setenv("NBTOOLS_STRAGGLER_WINDOW_S", "8")
    monkeypatch.setenv("NBTOOLS_STRAGGLER_CONFIRM_S", "3")
    seen: list[events.Event] = []
    lock = threading.Lock()

    def keep(batch):
        with lock:
            seen.extend(e for e in batch if e.kind in ("straggler", "hang"))

    @distributed(processes=3, cluster="ray", nodes=3)
    def train(seconds):
        import time

        import torch
        import torch.distributed as dist

        from nbtools import events

        t = torch.ones(1)
        slow = 3 if dist.get_rank() == 2 else 1
        began = time.monotonic()
        step = 0
        while True:
            end = time.monotonic() + 0.03 * slow
            while time.monotonic() < end:  # computes: rank 2 three times as long
                pass
            dist.all_reduce(t)
            step += 1
            events.step(step)
            done = torch.tensor([float(time.monotonic() - began > seconds)])
            dist.all_reduce(done)
            if done.item() > 0:
                return step

    events.subscribe(keep)
    try:
        train.distributed(25)
    finally:
        events.unsubscribe(keep)
    opened = [e for e in seen if not e.fields.get("ended")]
    assert {e.rank for e in opened if e.kind == "straggler"} == {2}, [e.message for e in seen]
    assert not [e for e in opened if e.kind == "hang"]


# The kernel on another host: a driver of its own, in a UTS namespace whose host name is not
# the nodes'. The watchdog takes a rank for local when the host in the rank's node label is
# the kernel's own host name, so here it reads none of the ranks' processes: it judges them by
# what each rank's probe reports of itself.
_ELSEWHERE = textwrap.dedent(
    """
    import json, os, socket, sys, threading
    import ray
    from nbtools import distributed, events

    ray.init(address=sys.argv[1], log_to_driver=False)
    seen, lock = [], threading.Lock()

    def keep(batch):
        with lock:
            seen.extend(e for e in batch if e.kind in ("straggler", "hang", "long_phase"))

    @distributed(processes=3, cluster="ray", nodes=3, hang_timeout=4)
    def train(seconds):
        import time

        import torch
        import torch.distributed as dist

        from nbtools import events

        rank, t = dist.get_rank(), torch.ones(1)
        slow = 3 if rank == 2 else 1

        def steps(count):
            for _ in range(count):
                end = time.monotonic() + 0.03 * slow
                while time.monotonic() < end:  # computes: rank 2 three times as long
                    pass
                dist.all_reduce(t)
                events.step()

        began = time.monotonic()
        while True:
            steps(10)
            done = torch.tensor([float(time.monotonic() - began > seconds)])
            dist.all_reduce(done)
            if done.item() > 0:
                break
        if rank == 0:  # rank 0 alone evaluates, at full CPU, while the others wait
            end = time.monotonic() + 10
            while time.monotonic() < end:
                torch.randn(128, 128) @ torch.randn(128, 128)
        dist.barrier()
        steps(10)
        if rank == 1:  # stuck in a call that uses no CPU, outside any collective
            time.sleep(12)
        steps(10)
        return os.environ["NBTOOLS_NODE"]

    events.subscribe(keep)
    try:
        labels = train.distributed(20)
    finally:
        events.unsubscribe(keep)
        ray.shutdown()
    with lock:
        found = [
            {"kind": e.kind, "rank": e.rank, "ended": bool(e.fields.get("ended"))} for e in seen
        ]
    print(json.dumps({"host": socket.gethostname(), "labels": labels, "flags": found}))
    """
)


def _other_host_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--uts", "true"]).returncode != 0:
        pytest.skip("a kernel on another host name needs unshare --uts (root)")
    return [unshare, "--uts", "sh", "-c", 'hostname nbtools-kernel-elsewhere && exec "$@"', "-"]


def test_with_the_kernel_on_another_host_ray_ranks_are_judged_by_their_own_probes(
    ray_cluster, tmp_path, monkeypatch
):
    monkeypatch.setenv("NBTOOLS_STRAGGLER_WINDOW_S", "8")
    monkeypatch.setenv("NBTOOLS_STRAGGLER_CONFIRM_S", "3")
    script = tmp_path / "driver.py"
    script.write_text(_ELSEWHERE)
    proc = subprocess.run(
        [*_other_host_prefix(), sys.executable, str(script), ray_cluster.address],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(label.split(events.NODE_SEPARATOR)[0] != out["host"] for label in out["labels"])
    opened = [f for f in out["flags"] if not f["ended"]]
    assert {f["rank"] for f in opened if f["kind"] == "straggler"} == {2}, out["flags"]
    assert [f["rank"] for f in opened if f["kind"] == "long_phase"] == [0], out["flags"]
    assert [f["rank"] for f in opened if f["kind"] == "hang"] == [1], out["flags"]
    assert [f["rank"] for f in out["flags"] if f["kind"] == "hang" and f["ended"]] == [1]


# A training thread that holds the GIL starves its rank's probe: the rank falls silent, and the
# kernel on another host has it looked at from its node (a task there reads its process).
_GIL = textwrap.dedent(
    """
    import json, sys, threading
    import ray
    from nbtools import distributed, events

    ray.init(address=sys.argv[1], log_to_driver=False)
    seen, lock = [], threading.Lock()

    def keep(batch):
        with lock:
            seen.extend(e for e in batch if e.kind in ("hang", "long_phase"))

    @distributed(processes=2, cluster="ray", nodes=2, hang_timeout=10)
    def train():
        import ctypes
        import re
        import time

        import torch
        import torch.distributed as dist

        from nbtools import events

        rank, t = dist.get_rank(), torch.ones(1)

        def steps(count):
            for _ in range(count):
                time.sleep(0.05)
                dist.all_reduce(t)
                events.step()

        steps(40)
        if rank == 0:  # busy in C for many seconds, holding the GIL
            re.match(r"(a+)+$", "a" * 30 + "b")
        steps(20)
        if rank == 1:  # libc's sleep through PyDLL: stuck, holding the GIL
            ctypes.PyDLL(None).sleep(20)
        steps(20)

    events.subscribe(keep)
    try:
        train.distributed()
    finally:
        events.unsubscribe(keep)
        ray.shutdown()
    with lock:
        found = [
            {"kind": e.kind, "rank": e.rank, "ended": bool(e.fields.get("ended")), "text": e.message}
            for e in seen
        ]
    print(json.dumps(found))
    """
)


def test_with_the_kernel_on_another_host_a_ray_rank_holding_the_gil_is_told_busy_or_stuck(
    ray_cluster, tmp_path
):
    script = tmp_path / "driver.py"
    script.write_text(_GIL)
    proc = subprocess.run(
        [*_other_host_prefix(), sys.executable, str(script), ray_cluster.address],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = json.loads(proc.stdout.strip().splitlines()[-1])
    opened = [f for f in flags if not f["ended"]]
    assert [f["rank"] for f in opened if f["kind"] == "long_phase"] == [0], flags
    (hang,) = [f for f in opened if f["kind"] == "hang"]
    assert hang["rank"] == 1 and "blocked in clock_nanosleep" in hang["text"], flags
