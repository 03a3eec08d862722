"""The events of one run of ``python -m nbtools demo`` (2 CPU ranks, lockstep DDP), as recorded.

A warm-up epoch, the run whose rank 1 SIGKILLs itself after step 13 (restarted, restored from
step 12 in memory), then the uninterrupted run. Rank 0 logs to MLflow before its first step
counts and saves every few steps (each save flushes a progress report); rank 1 waits for it in
the all-reduce and reports about once a second. Times are seconds after the first event.
"""

from __future__ import annotations

from nbtools.events import Event

__all__ = ["REPORTS", "EVENTS", "demo_events"]

#: The ranks' progress reports: (seconds, rank, pid, last step, steps so far).
REPORTS = [
    (3.535, 1, 8489, 0, 2), (4.508, 0, 8487, 2, 4), (4.52, 0, 8487, 3, 5),
    (4.538, 0, 8487, 4, 6), (4.613, 0, 8487, 7, 9), (4.614, 1, 8489, 7, 9),
    (6.931, 1, 8592, 0, 2), (7.914, 0, 8591, 0, 2), (8.001, 0, 8591, 4, 6),
    (8.038, 0, 8591, 7, 9), (8.12, 0, 8591, 11, 13), (8.149, 1, 8592, 13, 15),
    (9.573, 0, 8679, 13, 2), (10.336, 0, 8679, 20, 9), (10.371, 1, 8681, 23, 12),
    (10.371, 0, 8679, 23, 12), (12.651, 0, 8792, 3, 5), (12.706, 0, 8792, 7, 9),
    (12.718, 1, 8794, 8, 10), (12.75, 1, 8794, 9, 11), (12.756, 1, 8794, 10, 12),
    (12.795, 0, 8792, 12, 14), (12.83, 0, 8792, 15, 17), (12.882, 0, 8792, 20, 22),
    (12.925, 0, 8792, 23, 25), (12.925, 1, 8794, 23, 25),
]  # fmt: skip


def _saved(at: float, run: str, step: int, blocked: float, upload: float) -> tuple:
    message = f"saved /tmp/demo/{run}/checkpoints/step_{step}"
    fields = {"blocked_s": blocked, "upload_s": upload, "bytes": 89267}
    return (at, 0, "checkpoint_saved", message, step, fields)


_LAUNCH = "2 ranks (local)"
_KILLED = "rank 1 failed: the process was killed by SIGKILL"

#: Every other event: (seconds, rank, kind, message, step, fields).
EVENTS = [
    (0.0, None, "phase", "warm-up: one epoch, discarded", None, {}),
    (2.202, None, "launch", _LAUNCH, None, {"world_size": 2, "startup_s": 2.133}),
    _saved(4.533, "warm-up", 0, 0.0016, 0.0744),
    _saved(4.61, "warm-up", 4, 0.0064, 0.0493),
    _saved(4.671, "warm-up", 7, 0.0014, 0.0371),
    (4.766, None, "finished", "2 ranks returned", None, {"seconds": 4.696, "restarts": 0}),
    (5.555, None, "phase", "run 1: killed and recovered", None, {}),
    (5.578, None, "launch", _LAUNCH, None, {"world_size": 2, "startup_s": 0.022}),
    _saved(7.993, "recovered", 0, 0.0056, 0.0471),
    _saved(8.05, "recovered", 4, 0.0008, 0.0382),
    _saved(8.109, "recovered", 8, 0.0043, 0.0233),
    (8.149, 1, "sigkill", "rank 1 SIGKILLs itself", 13, {}),
    (8.161, 1, "rank_failed", _KILLED, None, {"reason": "Signal", "attempt": 0}),
    (8.162, None, "restart", _KILLED, None, {"attempt": 1, "max_restarts": 2}),
    (8.32, 0, "checkpoint_restored", "restored step 12 from memory", 12, {"seconds": 0.0367}),
    (9.573, 0, "resumed", "first step after the restore: 13", 13, {}),
    _saved(10.329, "recovered", 16, 0.0011, 0.0566),
    _saved(10.375, "recovered", 20, 0.0016, 0.0302),
    _saved(10.409, "recovered", 23, 0.0007, 0.0239),
    (10.483, None, "finished", "2 ranks returned", None, {"seconds": 4.927, "restarts": 1}),
    (10.486, None, "phase", "run 2: uninterrupted", None, {}),
    (10.506, None, "launch", _LAUNCH, None, {"world_size": 2, "startup_s": 0.019}),
    _saved(12.645, "uninterrupted", 0, 0.0043, 0.0337),
    _saved(12.704, "uninterrupted", 4, 0.0016, 0.0386),
    _saved(12.785, "uninterrupted", 8, 0.0018, 0.0477),
    _saved(12.829, "uninterrupted", 12, 0.0018, 0.0245),
    _saved(12.872, "uninterrupted", 16, 0.0015, 0.0232),
    _saved(12.922, "uninterrupted", 20, 0.0006, 0.0232),
    _saved(12.956, "uninterrupted", 23, 0.0006, 0.0136),
    (13.038, None, "finished", "2 ranks returned", None, {"seconds": 2.551, "restarts": 0}),
]


def demo_events(start: float, *, progress: bool = True, others: bool = True) -> list[Event]:
    """The recorded run as events from ``start`` (seconds since the epoch), in time order."""
    found = []
    if progress:
        found += [
            Event(start + t, "node-a", rank, pid, "progress", None, step, {"steps": n})
            for t, rank, pid, step, n in REPORTS
        ]
    if others:
        found += [
            Event(start + t, "node-a", rank, 7185, kind, message, step, dict(fields))
            for t, rank, kind, message, step, fields in EVENTS
        ]
    return sorted(found, key=lambda e: e.time)
