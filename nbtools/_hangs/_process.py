"""What a rank's process is doing, read from outside it: /proc and py-spy.

The kernel samples each local rank's main thread a few times a second from
``/proc/PID/stat`` (stopped?) and ``/proc/PID/syscall`` (blocked in which
system call?). A rank waiting for its peers in a collective blocks in
``futex`` (gloo and NCCL waits, ``Work.wait``); a rank that computes, sleeps,
reads files or waits for its loader is anywhere else. That split is the
"time outside collectives" the straggler score is built on, measured with no
code in the rank and nothing on its training thread.

Busy or stuck. A rank outside collectives may be working (an evaluation, a
compile whose workers are its child processes, a save whose threads write) or
stuck (a deadlock, a lost wake-up). :func:`usage` reads the CPU time and the
bytes read and written of the rank's whole process tree (its threads and
descendants) from ``/proc``; while they advance the rank is busy. Reading
them costs a few ``/proc`` reads per rank and tick, in the kernel.

Stacks come from ``py-spy dump --nonblocking`` (PyPI ``py-spy``), which reads
the process's memory and so works on a stopped or wedged process that could
never answer a signal. Without py-spy, the kernel-side state is reported and
the reason the stack is missing is said.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable

__all__ = [
    "WORKING",
    "WAITING",
    "STOPPED",
    "GONE",
    "sample",
    "usage",
    "stuck_by_state",
    "describe_state",
    "python_stacks",
]

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
PY_SPY_TIMEOUT_S = 15.0


def sample(pid: int, tid: int = 0) -> tuple[str, str]:
    """``(state, detail)`` of ``pid``'s thread ``tid`` (its main thread when 0 or gone).

    The state is one of the four above, the detail a word. Never raises: a
    process that is gone or unreadable is :data:`GONE`.
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
            call = f.read().split(b" ", 1)[0].decode()
    except OSError:
        wchan = _wchan(base)
        if wchan is None:
            return WORKING, "blocked"
        return (WAITING if "futex" in wchan else WORKING), wchan
    if call in _FUTEX:
        return WAITING, "futex"
    if call == "running":
        return WORKING, "running"
    return WORKING, _SYSCALL_NAMES.get(call, f"syscall {call}")


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


def stuck_by_state(
    states: dict[int, str | None], steps: dict[int, int], busy: set[int]
) -> list[int]:
    """Of ranks that all stopped: those stuck outside a collective, by their sampled state.

    Args:
        states: Each rank's state now (None: on another node, not sampled).
        steps: Each rank's steps so far.
        busy: Ranks whose process tree still works: outside, whatever their thread waits on.
    """
    states = {r: (WORKING if r in busy and s is not None else s) for r, s in states.items()}
    waiting = [r for r, s in states.items() if s == WAITING]
    outside = [r for r, s in states.items() if s in (WORKING, STOPPED)]
    stopped = [r for r, s in states.items() if s == STOPPED]
    unknown = [r for r, s in states.items() if s is None]
    most = max(steps.values(), default=0)
    lagging = [r for r in states if steps.get(r, 0) < most]
    if waiting and outside:
        return outside
    if stopped:
        return stopped
    if unknown and lagging:
        return lagging  # ranks elsewhere: the one behind is the likely culprit
    if (unknown and not outside) or (waiting and not outside):
        return list(states)  # nothing tells them apart, or the collective itself is stuck
    return []  # every rank is computing (an evaluation, a compile): not a hang


def describe_state(state: str, detail: str) -> str:
    """Words for a sampled state, for the cell's warning."""
    if state == STOPPED:
        return "stopped by a signal (SIGSTOP?)"
    if state == WAITING:
        return "waiting (blocked in futex: in a collective or on a lock)"
    if state == GONE:
        return "gone"
    if detail in ("running", "blocked"):
        return f"{detail}, outside any collective"
    return f"blocked in {detail}, outside any collective"


def python_stacks(pids: Iterable[int]) -> dict[int, str]:
    """Each process's Python stacks by ``py-spy dump``, or why they could not be read.

    The dumps run in parallel, each bounded by :data:`PY_SPY_TIMEOUT_S`.
    """
    pids = list(pids)
    spy = _py_spy()
    if spy is None:
        why = (
            "(no Python stack: py-spy is not installed in the kernel's environment; "
            "pip install py-spy)"
        )
        return {pid: why for pid in pids}
    procs: dict[int, subprocess.Popen[str] | str] = {}
    for pid in pids:
        try:
            procs[pid] = subprocess.Popen(
                [spy, "dump", "--pid", str(pid), "--nonblocking", "--full-filenames"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        except OSError as exc:
            procs[pid] = f"(no Python stack: py-spy could not start: {exc})"
    stacks: dict[int, str] = {}
    for pid, proc in procs.items():
        if isinstance(proc, str):
            stacks[pid] = proc
            continue
        try:
            out, _ = proc.communicate(timeout=PY_SPY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            stacks[pid] = f"(no Python stack: py-spy took over {PY_SPY_TIMEOUT_S:.0f} s)"
            continue
        if proc.returncode != 0:
            first = out.strip().splitlines()[:1]
            stacks[pid] = f"(no Python stack: py-spy failed: {first[0] if first else '?'})"
        else:
            stacks[pid] = _trim(out)
    return stacks


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _trim(dump: str) -> str:
    """The thread sections of a py-spy dump, without its header lines or colours (py-spy
    colours its output where the environment asks for colour, as a notebook kernel's does)."""
    lines = _ANSI.sub("", dump).rstrip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Thread "):
            return "\n".join(lines[i:])
    return "\n".join(lines)


def _py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")
