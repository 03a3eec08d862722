"""The lease both rooms hold (checkpoint writer, dataset listing): record, heartbeat, verdict."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from nbtools._internal.holder import Holder, machine_id, process_started
from nbtools._internal.lease import Heartbeat, LeaseWatch, Verdict, lease_holder, lease_record


def _ended_process() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_record_names_this_process_and_reads_back_as_its_holder():
    record = lease_record(job="j", since=1.0)
    assert record["host"] == socket.gethostname() and record["job"] == "j"
    assert lease_holder(record) == Holder.me()
    # An older version's record (host and pid only) names a process of this machine.
    old = lease_holder({"host": socket.gethostname(), "pid": 4321})
    assert old == Holder(machine_id(), 4321, None)
    assert lease_holder({"host": "another-node", "pid": 4321}) is None
    assert lease_holder(["not", "a", "record"]) is None


def test_a_lease_of_another_machine_is_pending_until_it_changes_or_stays_quiet():
    record = {"host": "node-b", "pid": 7, "started": 1.0, "machine": "node-b/boot/1"}
    watch = LeaseWatch(quiet_s=0.3, max_age_s=600.0)
    now = time.time()
    assert watch.judge(record, key="t1", mark=1, written_at=now) is Verdict.PENDING
    assert watch.watched == 1
    assert watch.judge(record, key="t1", mark=2, written_at=now) is Verdict.LIVE  # renewed
    while watch.judge(record, key="t1", mark=2, written_at=now) is Verdict.LIVE:
        time.sleep(0.05)
    assert watch.judge(record, key="t1", mark=2, written_at=now) is Verdict.GONE  # went quiet
    # Another holder's lease is a new one: watched afresh.
    assert watch.judge(record, key="t2", mark=2, written_at=now) is Verdict.PENDING
    watch.forget()
    assert watch.watched is None


def test_a_lease_too_old_by_its_own_clock_or_naming_a_dead_process_here_is_gone():
    far = {"host": "node-b", "pid": 7, "machine": "node-b/boot/1"}
    watch = LeaseWatch(quiet_s=30.0, max_age_s=600.0)
    assert watch.judge(far, key=1, mark=1, written_at=time.time() - 601) is Verdict.GONE
    assert watch.judge(far, key=1, mark=1, written_at=None) is Verdict.GONE
    dead = {**lease_record(), "pid": _ended_process()}
    assert watch.judge(dead, key=1, mark=1, written_at=time.time()) is Verdict.GONE
    # A live holder here is watched like any other unless fresh_local_s says otherwise.
    alive = {**lease_record(), "pid": os.getppid(), "started": None}
    assert watch.judge(alive, key=2, mark=1, written_at=time.time()) is Verdict.PENDING


def test_a_holder_here_with_a_fresh_lease_is_live_at_once_and_this_process_supersedes_its_own():
    watch = LeaseWatch(quiet_s=30.0, max_age_s=3600.0, fresh_local_s=60.0, mine_is_gone=True)
    running = {**lease_record(), "pid": os.getppid(), "started": process_started(os.getppid())}
    now = time.time()
    assert watch.judge(running, key=1, mark=1, written_at=now) is Verdict.LIVE
    assert watch.judge(running, key=1, mark=1, written_at=now - 61) is Verdict.GONE  # not renewed
    no_start = {**running, "started": None}  # no evidence of anything
    assert watch.judge(no_start, key=1, mark=1, written_at=now) is Verdict.GONE
    assert watch.judge(lease_record(), key=1, mark=1, written_at=now) is Verdict.GONE


def test_a_heartbeat_beats_until_stopped_or_until_a_beat_says_the_lease_is_lost():
    beats: list[str] = []
    steady = Heartbeat(lambda: beats.append(threading.current_thread().name), 0.01, "beat-a")
    steady.start()
    while len(beats) < 3:
        time.sleep(0.01)
    steady.stop()
    count = len(beats)
    time.sleep(0.05)
    assert len(beats) == count and set(beats) == {"beat-a"}

    lost: list[int] = []

    def once() -> bool:
        lost.append(1)
        return False

    ending = Heartbeat(once, 0.01, "beat-b").start()
    while not lost:
        time.sleep(0.01)
    ending.stop()  # already ended: returns at once
    assert lost == [1]
    Heartbeat(once, 0.01, "never").stop()  # never started: nothing to wait for
