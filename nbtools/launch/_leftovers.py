"""What a call starts, it ends: processes that ranks leave behind.

Each rank leads its own process group, so everything it starts (loader
workers, ``multiprocessing.Process``, ``subprocess.Popen``) is in that group
even after its parent is gone, unless it deliberately starts a new session.

- A rank whose function returned waits until every rank has returned, then
  gives its remaining descendants a short grace and stops them
  (:func:`end_own_leftovers`), and tells the caller which commands they were.
- After a failure or an interrupt, the caller stops what is left in the ranks'
  groups once the ranks themselves are gone (:func:`end_groups`).

Processes are never reaped here: a stopped child becomes a zombie that its own
parent (the rank, or its ``multiprocessing``/``subprocess`` handle) collects.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

__all__ = [
    "LEFTOVER_GRACE_S",
    "end_own_leftovers",
    "end_groups",
    "describe_process",
    "lead_own_group",
    "has_children",
    "is_library_service",
]

_STOP_GRACE_S = 1.0
# Per-process services that a library starts for the process and ends itself at interpreter
# exit (W&B's ``wandb-core`` after ``run.finish()``): a rank's process never exits on its own
# before nbtools stops what it left, so finding them is no fault of the user's code.
_LIBRARY_SERVICES = ("wandb-core", "wandb-service", "wandb_internal")
#: How long what a rank left running may take to end by itself once the rank returned.
LEFTOVER_GRACE_S = 2.0


def lead_own_group() -> None:
    """Make this process the leader of a new process group (its children inherit it)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


def has_children() -> bool:
    """Whether this process has any child process (cheap: no scan of every process)."""
    try:
        return bool(psutil.Process().children())
    except psutil.Error:
        return False


def describe_process(proc: psutil.Process) -> str:
    """``'sleep 1000' (pid 123)``, or the process name when the command line is unreadable."""
    try:
        cmdline = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        cmdline = "?"
    if "multiprocessing.forkserver" in cmdline or "multiprocessing" in cmdline:
        cmdline = "a forked Python child (multiprocessing.Process or a DataLoader worker)"
    elif len(cmdline) > 200:
        cmdline = cmdline[:197] + "..."
    return f"{cmdline!r} (pid {proc.pid})"


def is_library_service(description: str) -> bool:
    """Whether a :func:`describe_process` text names a library's per-process service."""
    command = description.rsplit(" (pid ", 1)[0]
    return any(service in command for service in _LIBRARY_SERVICES)


def _members(pgid: int, exclude: set[int]) -> list[psutil.Process]:
    # One getpgid per process id: far cheaper than psutil's process objects for all of them.
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        pids = psutil.pids()
    found = []
    for pid in pids:
        if pid in exclude:
            continue
        try:
            if os.getpgid(pid) == pgid:
                found.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    alive = _alive(procs)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = _alive(alive)
    return alive


def _stop(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    for proc in _wait_gone(procs, _STOP_GRACE_S):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _wait_gone(procs, _STOP_GRACE_S)


def end_own_leftovers(grace: float) -> list[str]:
    """In a rank: stop descendants still alive after ``grace`` seconds; describe them.

    Descendants are this process's children (recursively) and the other
    members of its process group (orphans whose parent already ended).
    """
    me = psutil.Process()
    try:
        procs = {p.pid: p for p in me.children(recursive=True)}
    except psutil.Error:
        procs = {}
    with contextlib.suppress(OSError):
        if os.getpgid(0) == me.pid:
            procs.update((p.pid, p) for p in _members(me.pid, {me.pid}))
    alive = _wait_gone(list(procs.values()), grace)
    if not alive:
        return []
    described = [describe_process(p) for p in alive]
    _stop(alive)
    return described


def end_groups(pgids: list[int], exclude: set[int] | None = None) -> list[str]:
    """In the caller: stop every process left in these (ranks') process groups; describe them."""
    exclude = set(exclude or ()) | {os.getpid()}
    alive = _alive([p for pgid in pgids for p in _members(pgid, exclude)])
    described = [describe_process(p) for p in alive]
    _stop(alive)
    return described
