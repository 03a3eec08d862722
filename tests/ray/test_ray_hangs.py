"""A hung Ray rank, flagged by the kernel: named by its Ray node, with the collective.

The test cluster's nodes share one machine and so one host name: each rank's
node label carries the start of its Ray node id, as the GPU pane's labels do.
"""

from __future__ import annotations

import logging
import os
import signal
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
