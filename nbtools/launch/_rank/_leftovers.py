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
A process counts as ended once it runs no more code of its own (:func:`ending`):
the kernel may take a while longer to free a large process's memory, which
nothing here waits for.
"""

from __future__ import annotations

import contextlib
import gc
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
    "ending",
    "runs_own_code",
    "exit_code",
    "await_ending",
]

_STOP_GRACE_S = 1.0
# ``flags`` of /proc/<pid>/stat: the process's main thread has begun to exit.
_PF_EXITING = 0x4
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


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def ending(pid: int) -> bool:
    """Whether process ``pid`` runs no code of its own any more: gone, a zombie, or its
    main thread exiting (killed by a signal or past its exit, the kernel is releasing
    its memory: a tenth of a second or more for a process of a few GB). A process
    that exits this way does so as a whole: its other threads never return to it."""
    fields = _stat(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return True
        try:  # no /proc here: ask psutil
            return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except psutil.Error:
            return True
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)


def runs_own_code(proc: psutil.Process | None) -> bool:
    """Whether ``proc`` (None: never started) is alive and still runs code of its own
    (see :func:`ending`)."""
    if proc is None:
        return False
    try:
        return proc.is_running() and not ending(proc.pid)
    except psutil.Error:
        return False


def exit_code(pid: int) -> int | None:
    """The exit code of ending process ``pid`` as ``multiprocessing`` reports it (``-N``:
    killed by signal N), read from ``/proc/<pid>/stat`` before anything reaps it; None
    when it cannot be known there (still running, gone, or an older kernel)."""
    for look in range(2):
        fields = _stat(pid)
        if fields is None or len(fields) < 50 or not ending(pid):
            return None
        status = int(fields[49])
        if status or fields[0] in ("Z", "X", "x") or look:
            return -(status & 0x7F) if status & 0x7F else status >> 8
        # The kernel sets the code a moment after the exit begins (before it releases
        # the memory): a 0 read that early is looked at once more.
        time.sleep(0.01)
    return None  # pragma: no cover


def await_ending(procs: dict[int, psutil.Process | None], grace: float) -> set[int] | None:
    """Wait until every process of ``procs`` (by rank) is :func:`ending`; SIGKILL those
    still running after ``grace`` seconds and wait as long again. Returns the ranks that
    needed SIGKILL, or None when some never ended (stuck in the kernel)."""

    def runs(proc: psutil.Process | None) -> bool:
        try:  # is_running also tells a reused process id apart
            return proc is not None and proc.is_running() and not ending(proc.pid)
        except psutil.Error:
            return False

    killed: set[int] = set()
    for killing in (False, True):
        deadline = time.monotonic() + grace
        for rank, proc in procs.items():
            if killing and runs(proc):
                killed.add(rank)
                with contextlib.suppress(psutil.Error, OSError):
                    proc.kill()  # type: ignore[union-attr]
        while any(runs(p) for p in procs.values()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        else:
            return killed
    return None


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
            if proc.is_running() and not ending(proc.pid):
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
            proc.resume()  # a stopped process acts on SIGTERM only once continued
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


def end_rank_leftovers(grace: float = LEFTOVER_GRACE_S) -> list[str]:
    """At a rank's end: :func:`end_own_leftovers`, once loaders kept by a cycle are collected."""
    if has_children():
        # Loaders that only a reference cycle keeps alive shut their workers down cleanly now.
        gc.collect()
    for _ in range(3):
        try:
            return end_own_leftovers(grace)
        except RuntimeError:
            # torch's DataLoader raises from its SIGCHLD handler when a worker it still
            # tracks is stopped; the worker is stopped all the same.
            continue
    return []


def end_groups(pgids: list[int], exclude: set[int] | None = None) -> list[str]:
    """In the caller: stop every process left in these (ranks') process groups; describe them."""
    exclude = set(exclude or ()) | {os.getpid()}
    alive = _alive([p for pgid in pgids for p in _members(pgid, exclude)])
    described = [describe_process(p) for p in alive]
    _stop(alive)
    return described
