"""What a rank's process is doing, read from outside it: /proc and py-spy.

The kernel samples each local rank's main thread a few times a second from
``/proc/PID/stat`` (stopped?) and ``/proc/PID/syscall`` (blocked in which
system call?). A rank waiting for its peers in a collective blocks in
``futex`` (gloo and NCCL waits, ``Work.wait``); a rank that computes, sleeps,
reads files or waits for its loader is anywhere else. That split is the
"time outside collectives" the straggler score is built on, measured with no
code in the rank and nothing on its training thread.

The readers (``sample``, ``usage``) and the states they name live in
:mod:`nbtools.events._probe`, where a rank also uses them on itself (a rank on
another machine reports what they read with its progress).

Busy or stuck. A rank outside collectives may be working (an evaluation, a
compile whose workers are its child processes, a save whose threads write) or
stuck (a deadlock, a lost wake-up). ``_probe.usage`` reads the CPU time and the
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

from nbtools.events._probe import GONE, STOPPED, WAITING, WORKING

__all__ = [
    "stuck_by_state",
    "describe_state",
    "python_stacks",
]

PY_SPY_TIMEOUT_S = 15.0


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
