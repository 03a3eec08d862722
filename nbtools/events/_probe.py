"""A rank's look at its own training thread: in a collective, working, or stopped.

The kernel samples the ranks on its own machine from outside (``/proc``, see
``nbtools._hangs``); a rank on another machine (Ray, with the kernel on
another host) it cannot see. So each rank also samples itself: a daemon thread
(:class:`Probe`) reads its training thread's state from
``/proc/self/task/TID`` ten times a second, and the progress report, once a
second, carries what it saw (:meth:`Probe.take`): how many samples found the
thread waiting in a futex (a collective, or a lock) and how many working, the
state now, and the CPU seconds and I/O bytes of the rank's process tree so
far. The kernel reads these for the ranks it cannot see: the share of time
outside collectives (straggler scores), and busy or stuck (a long phase or a
hang). A stopped rank cannot report: the kernel reads its silence.

The readers (:func:`sample`, :func:`usage`) are the kernel's too. They cost a
few ``/proc`` reads: about 0.03 % of a core in the rank at ten samples a
second, and one read of the tree a second.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

__all__ = [
    "WORKING",
    "WAITING",
    "STOPPED",
    "GONE",
    "sample",
    "usage",
    "gil_range",
    "Probe",
    "PERIOD_S",
]

#: How often a rank's probe samples its training thread.
PERIOD_S = 0.1
_RECENT = 20  # the state "now": the majority of this many latest samples

#: Running, or blocked anywhere but a futex: computing, sleeping, reading.
WORKING = "working"
#: Blocked in a futex: waiting for peers in a collective (or for a lock).
WAITING = "waiting"
#: Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer.
STOPPED = "stopped"
#: The process is gone or cannot be read.
GONE = "gone"

_FUTEX = {"202", "98"}  # futex on x86_64 and on aarch64
_SYSCALL_NAMES = {
    "0": "read",
    "7": "poll",
    "23": "select",
    "35": "nanosleep",
    "202": "futex",
    "230": "clock_nanosleep",
    "232": "epoll_wait",
    "281": "epoll_pwait",
    "61": "wait4",
    "271": "ppoll",
    "45": "recvfrom",
    "47": "recvmsg",
    "101": "nanosleep",
    "73": "ppoll",
    "63": "read",
}


def sample(pid: int, tid: int = 0, gil: tuple[int, int] | None = None) -> tuple[str, str]:
    """``(state, detail)`` of ``pid``'s thread ``tid`` (its main thread when 0 or gone).

    The state is one of the four above, the detail a word. Never raises: a
    process that is gone or unreadable is :data:`GONE`. ``gil``: the range of
    futex addresses a thread of this process waits on for the interpreter lock
    (:func:`gil_range`): such a wait is work to do, not a wait for peers.
    """
    base = f"/proc/{pid}/task/{tid}" if tid and tid != pid else f"/proc/{pid}"
    try:
        with open(f"{base}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return sample(pid) if base != f"/proc/{pid}" else (GONE, "gone")
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    if state in (b"T", b"t"):
        return STOPPED, "stopped by a signal"
    if state in (b"Z", b"X"):
        return GONE, "exited"
    if state == b"R":
        return WORKING, "running"
    try:
        with open(f"{base}/syscall", "rb") as f:
            parts = f.read().split()
        call = parts[0].decode() if parts else "running"
    except OSError:
        wchan = _wchan(base)
        if wchan is None:
            return WORKING, "blocked"
        return (WAITING if "futex" in wchan else WORKING), wchan
    if call in _FUTEX:
        if gil is not None and len(parts) > 1 and gil[0] <= _address(parts[1]) <= gil[1]:
            return WORKING, "waiting for the GIL"
        return WAITING, "futex"
    if call == "running":
        return WORKING, "running"
    return WORKING, _SYSCALL_NAMES.get(call, f"syscall {call}")


def _address(word: bytes) -> int:
    try:
        return int(word, 16)
    except ValueError:
        return -1


_GIL_SPAN = 256  # bytes around the addresses seen: the lock's mutex and conditions


def gil_range(seconds: float = 0.1) -> tuple[int, int] | None:
    """The futex addresses a thread of this process waits on for the interpreter lock.

    A probe that samples its own process holds the lock as it looks, so a training
    thread that runs Python code is always found waiting for it. To tell that wait
    from a wait for peers, a short-lived thread spins in Python while this one reads
    where it waits. None when none was seen (then every futex is a wait).
    """
    done = threading.Event()
    tids: list[int] = []

    def spin() -> None:
        tids.append(threading.get_native_id())
        while not done.is_set():
            pass

    spinner = threading.Thread(target=spin, name="nbtools-probe-gil", daemon=True)
    spinner.start()
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not tids:
                continue
            try:
                with open(f"/proc/self/task/{tids[0]}/syscall", "rb") as f:
                    parts = f.read().split()
            except OSError:
                break
            if len(parts) > 1 and parts[0].decode() in _FUTEX:
                seen.add(_address(parts[1]))
    finally:
        done.set()
        spinner.join(1.0)
    seen.discard(-1)
    return (min(seen) - _GIL_SPAN, max(seen) + _GIL_SPAN) if seen else None


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MAX_TREE = 256  # processes read per rank's tree, at most


def usage(pid: int) -> tuple[float, int] | None:
    """``(CPU seconds, bytes read and written)`` of ``pid`` and its descendants so far.

    None when ``pid`` is gone or cannot be read. Threads count with their process;
    children that exited and were waited for count in their parent's CPU time.
    """
    cpu, io = 0.0, 0
    seen: set[int] = set()
    todo = [pid]
    while todo and len(seen) < _MAX_TREE:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            if current == pid:
                return None
            continue
        # After the name: state is field 3, utime..cstime are fields 14-17.
        cpu += sum(int(v) for v in fields[11:15]) / _TICKS
        io += _io_bytes(current)
        todo.extend(_children(current))
    return cpu, io


def _io_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            values = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    except (OSError, ValueError):
        return 0
    try:
        return int(values.get(b"rchar", 0)) + int(values.get(b"wchar", 0))
    except ValueError:
        return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _wchan(base: str) -> str | None:
    try:
        with open(f"{base}/wchan") as f:
            return f.read().strip() or None
    except OSError:
        return None


class Probe:
    """Samples thread ``tid`` of this process every :data:`PERIOD_S` on a daemon thread.

    Args:
        tid: The native id of the thread to sample (the training thread).
    """

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self._pid = os.getpid()
        self._working = 0
        self._waiting = 0
        self._recent: deque[tuple[str, str]] = deque(maxlen=_RECENT)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbtools-probe", daemon=True)

    def start(self) -> Probe:
        """Start sampling; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (a rank's probe runs until its process ends)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)

    def _run(self) -> None:
        gil = gil_range()
        while not self._stop.wait(PERIOD_S):
            kind, detail = sample(self._pid, self.tid, gil)
            with self._lock:
                self._recent.append((kind, detail))
                if kind == WAITING:
                    self._waiting += 1
                elif kind != GONE:
                    self._working += 1

    def take(self) -> dict[str, Any]:
        """The fields a progress report carries: the samples since the last call
        (``working``, ``waiting``), the state now (``state``, ``detail``) and the
        process tree's use so far (``tree_cpu`` seconds, ``tree_io`` bytes)."""
        with self._lock:
            working, waiting = self._working, self._waiting
            self._working = self._waiting = 0
            recent = list(self._recent)
        fields: dict[str, Any] = {"working": working, "waiting": waiting}
        if recent:
            counts: dict[str, int] = {}
            for kind, _ in recent:
                counts[kind] = counts.get(kind, 0) + 1
            kind = max(counts, key=counts.__getitem__)
            fields["state"] = kind
            fields["detail"] = next(d for k, d in reversed(recent) if k == kind)
        used = usage(self._pid)
        if used is not None:
            fields["tree_cpu"], fields["tree_io"] = round(used[0], 3), used[1]
        return fields
