"""``Holder``: is the process a record names alive, here or on another machine?"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from nbtools._internal.holder import Holder, Liveness, machine_id, process_started


def test_start_times_agree_with_psutils_create_time():
    # Records written by earlier versions hold psutil's create_time: they must still match.
    for pid in (os.getpid(), os.getppid(), 1):
        assert abs(process_started(pid) - psutil.Process(pid).create_time()) < 1.0


def test_this_process_is_alive():
    me = Holder.me()
    assert me.pid == os.getpid() and me.machine == machine_id() and me.here
    assert me.alive() is Liveness.ALIVE


def test_an_ended_process_is_dead():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(proc.pid).create_time()
    proc.wait()
    assert process_started(proc.pid) is None
    assert Holder(machine_id(), proc.pid, started).alive() is Liveness.DEAD


def test_an_exited_process_not_yet_reaped_is_dead():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        started = process_started(proc.pid)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # not reaped: a zombie now
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        assert Holder(machine_id(), proc.pid, started).alive() is Liveness.DEAD
    finally:
        proc.wait()


def test_a_reused_process_id_is_another_process():
    # Process 1 runs, but it is not the process recorded as started a minute ago.
    holder = Holder(machine_id(), 1, process_started(1) + 60.0)
    assert holder.alive() is Liveness.DEAD


def test_a_holder_without_a_start_time_is_judged_by_its_pid():
    assert Holder(machine_id(), os.getppid(), None).alive() is Liveness.ALIVE


def test_another_machines_holder_cannot_be_told():
    assert Holder("elsewhere/boot/1", os.getpid(), 0.0).alive() is Liveness.UNKNOWN


@pytest.mark.parametrize(
    "record",
    [None, [], {}, {"pid": "12", "machine": "m"}, {"pid": True, "machine": "m"}, {"pid": 3}],
)
def test_a_record_without_a_holder_names_none(record):
    assert Holder.from_record(record) is None


def test_a_record_round_trips_and_keeps_its_keys():
    me = Holder.me()
    assert Holder.from_record({**me.record(), "host": "h", "time": 1.0}) == me
    assert set(me.record()) == {"pid", "started", "machine"}
    assert Holder.from_record({"pid": 3, "machine": "m", "started": "x"}).started is None
