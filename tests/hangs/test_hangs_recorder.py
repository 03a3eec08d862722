"""The Flight Recorders read right: NCCL's beside gloo's, and the culprits they name.

The dumps here are in the format torch 2.13 writes (``"version": "2.10"``):
gloo's is a dump ``_dump_fr_trace_json`` wrote on this machine (counters as
strings, ``state`` left at ``scheduled`` and no times of completion); NCCL's
follows what torch's own tests check of ``_dump_nccl_trace_json``
(``test/distributed/test_c10d_nccl.py``, ``NCCLTraceTest._verify_trace`` and
``test_trace_while_active``: ``state`` is ``scheduled``, ``started`` with
timing on, or ``completed``; ``duration_ms`` only with timing on) and the
fields torch's analysis tools read (``torch/distributed/flight_recorder/
components/types.py``, ``Op`` and ``EntryState``).
"""

from __future__ import annotations

import json
import sys
import time
import types

import pytest

from nbtools import events
from nbtools._hangs import Watchdog, _collectives
from nbtools._hangs._collectives import Position
from nbtools._hangs._state import RankState
from nbtools.events import Event, _probe, _recorder

_S = 1_000_000_000  # nanoseconds


class _Clock:
    """The kernel's monotonic clock, moved on by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _progress(rank: int, pid: int, steps: int, at: float, host: str) -> Event:
    return Event(at, host, rank, pid, "progress", None, steps, {"steps": steps, "cpu": 0.0})


@pytest.fixture
def flags():
    seen: list[Event] = []

    def keep(batch):
        seen.extend(e for e in batch if e.kind in ("hang", "straggler"))

    events.subscribe(keep)
    yield seen, None
    events.unsubscribe(keep)


_T0 = 1_796_658_000 * _S


def _entry(seq, op="all_reduce", *, backend="nccl", pg=0, state="completed", at=0.0, took=0.01,
           numel=1024, timing=False):  # fmt: skip
    """One record as torch writes it; ``at`` and ``took`` in seconds from _T0."""
    created = _T0 + int(at * _S)
    entry = {
        "record_id": seq - 1,
        "pg_id": pg,
        "process_group": [str(pg), "default_pg" if pg == 0 else "undefined"],
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"{backend}:{op}",
        "time_created_ns": created,
        "input_sizes": [[numel]],
        "input_dtypes": ["Float"],
        "output_sizes": [[numel]],
        "output_dtypes": ["Float"],
        "state": state,
        "retired": state == "completed",
        "timeout_ms": 600000,
        "is_p2p": False,
        "thread_id": "140046592367488",
        "thread_name": "pt_main_thread",
        "time_discovered_started_ns": created if timing and state != "scheduled" else None,
        "time_discovered_completed_ns": created + int(took * _S) if state == "completed" else None,
    }
    if timing and state == "completed":
        entry["duration_ms"] = took * 1000
    return entry


def _nccl(completed, enqueued, ops=None, *, timing=False, states=None):
    """A rank's NCCL dump: collectives 1..enqueued issued, 1..completed done."""
    ops, states = ops or {}, states or {}
    entries = [
        _entry(
            seq,
            ops.get(seq, "all_reduce"),
            state="completed" if seq <= completed else states.get(seq, "scheduled"),
            at=seq * 0.1,
            timing=timing,
        )
        for seq in range(1, enqueued + 1)
    ]
    started = max(
        (e["collective_seq_id"] for e in entries if e["state"] != "scheduled"), default=-1
    )
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": enqueued,
                "last_started_collective": started if timing else -1,
                "last_completed_collective": completed,
            }
        },
        "entries": entries,
    }


# Written by _dump_fr_trace_json on this machine (torch 2.13, CPU build), one gloo
# all_reduce of 4 floats on the default group.
_GLOO = json.loads(
    '{"comm_lib_version":"","entries":[{"collective_seq_id":1,"input_dtypes":["Float"],'
    '"input_sizes":[[4]],"is_p2p":false,"op_id":1,"output_dtypes":["Float"],'
    '"output_sizes":[[4]],"p2p_seq_id":0,"pg_id":0,"process_group":["0","default_pg"],'
    '"profiling_name":"gloo:all_reduce","record_id":0,"retired":true,"state":"scheduled",'
    '"thread_id":"140046592367488","thread_name":"python","time_created_ns":'
    '1796658006664900261,"time_discovered_completed_ns":0,"time_discovered_started_ns":0,'
    '"timeout_ms":1800000}],"nccl_comm_state":{},"pg_config":{"":{"desc":"","name":"",'
    '"ranks":"[]"}},"pg_status":{"0":{"last_completed_collective":"1",'
    '"last_enqueued_collective":"1","last_started_collective":"-1"}},"version":"2.10"}'
)


def _answers(dumps):
    """What the kernel gets from each rank: its answer's fields, as sent."""
    return {
        rank: [Position.of(fields) for fields in _recorder.positions(dump, "nccl")]
        for rank, dump in dumps.items()
    }


def test_waiting_ranks_that_ran_ahead_by_different_amounts_are_not_culprits():
    # NCCL issues asynchronously: rank 0 ran three collectives ahead of the stuck one,
    # rank 1 one; rank 2 never issued #11. The stuck one is min(completed) + 1.
    answers = _answers({0: _nccl(10, 13), 1: _nccl(10, 11), 2: _nccl(10, 10)})
    (flight,) = _collectives.in_flight(answers)
    assert (flight.seq, flight.op, flight.inside, flight.behind) == (
        11,
        "all_reduce",
        [0, 1],
        {2: 10},
    )
    assert _collectives.culprits_of(answers) == [2]
    (line,) = _collectives.describe(answers, [2], 3)
    assert line == (
        "ranks 0, 1 wait in all_reduce #11, which rank 2 never entered (last entered: rank 2: #10)"
    )


def test_a_mismatched_collective_on_nccl_names_each_rank_and_its_op():
    answers = _answers({0: _nccl(67, 69, {68: "all_reduce"}), 1: _nccl(67, 68, {68: "broadcast"})})
    assert _collectives.culprits_of(answers) == [0, 1]
    (line,) = _collectives.describe(answers, [0, 1], 2)
    assert (
        line
        == "rank 0 is in all_reduce #68 (4 KB), rank 1 in broadcast #68: a mismatched collective"
    )


def test_on_nccl_the_record_and_the_gpus_decide_when_every_rank_issued_the_collective():
    # Timing on: the devices of ranks 0 and 2 began #11, rank 1's never did.
    timed = {r: _nccl(10, 11, timing=True, states={11: "started"}) for r in (0, 2)}
    timed[1] = _nccl(10, 11, timing=True)
    assert _collectives.culprits_of(_answers(timed)) == [1]
    # Timing off: every record says "scheduled"; NVML breaks the tie, the waiting GPUs
    # spin at full use while the culprit's idles.
    answers = _answers({r: _nccl(10, 11) for r in range(3)})
    busy = {r: [p._replace(gpu_util=u) for p in answers[r]] for r, u in ((0, 100), (1, 3), (2, 99))}
    assert _collectives.culprits_of(busy) == [1]
    # Nothing tells them apart: the collective itself is stuck, and every rank is in it.
    assert _collectives.culprits_of(answers) == [0, 1, 2]


def test_both_recorders_are_read_and_their_groups_kept_apart(monkeypatch):
    # The default group's gloo and NCCL sides share id 0; NCCL's is listed first.
    calls = []

    def dump(text):
        def call(includeCollectives=True, onlyActive=False):
            calls.append((includeCollectives, onlyActive))
            return text.encode()

        return call

    c10d = types.SimpleNamespace(
        _dump_fr_trace_json=dump(json.dumps(_GLOO)),
        _dump_nccl_trace_json=dump(json.dumps(_nccl(6, 7))),
    )
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", c10d)
    monkeypatch.setattr(_recorder, "gpu_utilisation", lambda read=None: 87.0)
    fields = _recorder.read_positions()
    assert calls == [(True, False), (True, False)]
    assert [f["pg"] for f in fields] == ["nccl:0", "gloo:0"]
    nccl, gloo = (Position.of(f) for f in fields)
    assert (nccl.enqueued, nccl.completed, nccl.op, nccl.size, nccl.gpu_util) == (
        7,
        6,
        "all_reduce",
        4096,
        87.0,
    )
    assert nccl.pending == (_collectives.Pending(7, "all_reduce", 4096, "scheduled"),)
    assert (gloo.enqueued, gloo.completed, gloo.op, gloo.size, gloo.gpu_util) == (
        1,
        1,
        "all_reduce",
        16,
        None,
    )
    # A CPU build has no NCCL recorder: gloo's alone.
    monkeypatch.delattr(c10d, "_dump_nccl_trace_json")
    assert [f["pg"] for f in _recorder.read_positions()] == ["gloo:0"]


def test_time_outside_collectives_comes_from_the_record_and_marks_the_straggler():
    # Both ranks step every second. Rank 0 computes 0.9 s and waits 0.1 s in its
    # all-reduce; rank 1, the straggler, computes 0.99 s and waits 0.01 s.
    def rank(wait, timing):
        entries = [_entry(s, at=s * 1.0 - wait, took=wait, timing=timing) for s in range(1, 31)]
        return {"version": "2.10", "pg_status": {}, "entries": entries}

    now = _T0 + 30 * _S
    for timing in (True, False):
        fast = _recorder.outside_share(rank(0.1, timing), 20.0, now)
        slow = _recorder.outside_share(rank(0.01, timing), 20.0, now)
        assert fast is not None and slow is not None
        assert round(fast, 2) == 0.9 and round(slow, 2) == 0.99
    # gloo records no times of completion: nothing to measure.
    assert _recorder.outside_share(_GLOO, 20.0, now) is None


def test_on_nccl_ranks_the_watchdog_never_reads_waiting_from_proc():
    # Both ranks stalled and no collective is in flight; /proc reads rank 0 as
    # blocked in a futex and rank 1 as running: on gloo rank 1 is the one outside.
    def judged(backend):
        dog = Watchdog(2, hang_timeout=1.0)
        for rank, kind in ((0, _probe.WAITING), (1, _probe.WORKING)):
            state = RankState(rank, "node-a", 100 + rank, local=True, steps=5)
            state.recent.extend([(kind, "futex" if rank == 0 else "running")] * 5)
            dog._ranks[rank] = state
        dog._answers = {r: [Position(f"{backend}:0", 9, 9, "all_reduce", 9, 16)] for r in (0, 1)}
        dog._answered_at = time.monotonic()
        return [s.rank for s in dog._outside(dog._world(), time.monotonic())]

    assert judged("gloo") == [1]
    # On NCCL a rank waiting on its GPU spins (state R): /proc says nothing about who waits.
    assert judged("nccl") == []


def test_a_gpu_rank_is_scored_by_the_share_outside_collectives_it_reports(flags):
    # Three GPU ranks step together; rank 2 computes twice as long, so ranks 0 and 1
    # spend half their time waiting in NCCL and rank 2 almost none. /proc would read
    # every rank as running (a spin): the share they report decides.
    seen, _ = flags
    clock = _Clock()
    dog = Watchdog(3, confirm_s=0.5, clock=clock)
    now = time.time()
    for step in range(1, 8):
        batch = []
        for rank, outside in ((0, 0.5), (1, 0.52), (2, 0.99)):
            report = _progress(rank, 100 + rank, step, now + step, host=f"gpu-{rank} · 1a2b")
            report.fields["outside"] = outside
            batch.append(report)
        dog._on_events(batch)
        dog._stragglers.judge(dog._ranks, clock.now)
        clock.now += 1.0
    dog._send_posted()
    (flag,) = dog.flags()
    assert (flag.kind, flag.rank) == ("straggler", 2)
    assert round(flag.score, 2) == round(0.52 / 0.99, 2)
    (event,) = [e for e in seen if e.kind == "straggler"]
    assert event.rank == 2 and "outside collectives" in event.message


def test_a_rank_measures_its_share_outside_nccl_collectives_only_where_nccl_is(monkeypatch):
    monkeypatch.setattr(_recorder, "_device", [None, -1e9, True])
    now = time.time_ns()
    steps = [_entry(s, took=0.25) for s in range(1, 21)]
    for i, entry in enumerate(steps):  # one collective of 0.25 s each second, until now
        entry["time_created_ns"] = now - (20 - i) * _S
        entry["time_discovered_completed_ns"] = entry["time_created_ns"] + _S // 4
    c10d = types.SimpleNamespace(
        _dump_nccl_trace_json=lambda **_: json.dumps({"entries": steps}).encode()
    )
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", c10d)
    assert round(_recorder.device_outside(10.0), 2) == 0.75
    # A CPU build has no NCCL recorder: nothing, and no further look.
    monkeypatch.setattr(_recorder, "_device", [None, -1e9, True])
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", types.SimpleNamespace())
    assert _recorder.device_outside(10.0) is None and _recorder._device[2] is False


def test_the_words_name_the_rank_whose_gpu_holds_the_collective_up():
    timed = {r: _nccl(10, 11, timing=True, states={11: "started"}) for r in (0, 2)}
    timed[1] = _nccl(10, 11, timing=True)
    (line,) = _collectives.describe(_answers(timed), [1], 3)
    assert (
        line
        == "ranks 0, 1, 2 wait in all_reduce #11, held up by rank 1, whose GPU never started it"
    )
    answers = _answers({r: _nccl(10, 11) for r in range(2)})
    busy = {r: [p._replace(gpu_util=u) for p in answers[r]] for r, u in ((0, 100), (1, 3))}
    (line,) = _collectives.describe(busy, [1], 2)
    assert line.endswith("held up by rank 1, whose GPU idles (rank 0: 100 %, rank 1: 3 %)"), line
