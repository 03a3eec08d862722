"""The forkserver's own side: settled out of the caller's way, and what it ends when it ends.

Ranks start from multiprocessing's forkserver (:mod:`nbtools.launch._env`).
This module is the first the forkserver preloads. There it:

- leaves the caller's process group: Jupyter kernels terminate every process of
  their group at shutdown and wait for them; the forkserver and its ranks end
  by themselves once the kernel is gone (below), and stay out of that;
- gives the ranks a private torch compile cache (``TORCHINDUCTOR_CACHE_DIR``,
  unless the caller set one) inside the caller's ``pymp-*`` directory, instead
  of ``$TMPDIR/torchinductor_<user>``, which nothing would remove;
- loads the installed object-store clients (``_OPTIONAL_PRELOAD``);
- once every preload is in, freezes its objects out of the garbage collector
  (:func:`mark_ready`), so that a rank's full collection walks only its own;
- ends what the caller's launches left when the forkserver ends.

The forkserver ends once the caller is gone, however it went: its end of the
forkserver's "alive" pipe closes, even on SIGKILL. At that moment the caller's
``finally`` blocks may not have run (a SIGKILL, a kernel killed by its
manager), so the forkserver does what they would have: it SIGKILLs every rank
it started and the process group each rank leads (SIGKILL ends a stopped
process too), waits for them, runs the launch-end hooks of the launches still
running (the memory tier's snapshots of those runs on this node go), removes
their run directories, then the ``pymp-*`` directory (its socket, the compile
cache). multiprocessing removes that directory in the caller's exit handlers,
which do not run when a kernel is killed.

A first call that comes while the forkserver still imports its preloads starts
its ranks fresh (``spawn``) instead of waiting; the caller stops the
forkserver meanwhile (:func:`pause`, :func:`resume`) so that the ranks' own
imports have the cores.

The caller records each running launch in the ``pymp-*`` directory
(:func:`note_launch`, :func:`forget_launch`) for that purpose. Nothing here
runs in any process but the forkserver, except those two and
:func:`rank_environment`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import multiprocessing.util
import os
import re
import shutil
import signal
import socket
import time

__all__ = [
    "note_launch",
    "forget_launch",
    "rank_environment",
    "settle",
    "mark_ready",
    "ready",
    "pause",
    "resume",
]

#: Object-store clients the forkserver also loads when they are installed (a rank that
#: reads or writes checkpoints in a bucket imports one: half a second per rank, per
#: restart). Imported with every error tolerated: a broken one is skipped, never fatal.
_OPTIONAL_PRELOAD = ("s3fs", "gcsfs", "adlfs")
# In the pymp-* directory: one record per running launch, and the ranks' compile cache.
_LAUNCHES = "nbtools-launches"
_COMPILE_CACHE = "torchinductor"
# Made by the forkserver once its last preload is imported (``_forkserver_ready``).
_READY = "nbtools-forkserver-ready"
# Made by the forkserver once it would resume by itself if its caller died (``settle``).
_SETTLED = "nbtools-forkserver-settled"
_PR_SET_PDEATHSIG = 1
# A forkserver this old counts as ready even without the file (one started elsewhere).
_READY_AFTER_S = 60.0
# Variables a launch-end hook reads from the launch's environment (where its snapshots are).
_HOOK_ENV = ("NBTOOLS_SNAPSHOT_DIR",)
# How long the ended forkserver waits for the ranks it SIGKILLed to be gone.
_REAP_S = 5.0


def _launches_dir(temp_dir: str) -> str:
    return os.path.join(temp_dir, _LAUNCHES)


def note_launch(
    run_id: str, run_dir: str, env: dict[str, str], groups: list[int] | None = None
) -> None:
    """In the caller: record a running launch, for the forkserver to end if the caller dies;
    ``groups``: the process groups its ranks lead (recorded again with each attempt)."""
    directory = _launches_dir(multiprocessing.util.get_temp_dir())
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    record = {
        "run_dir": run_dir,
        "env": {k: env[k] for k in _HOOK_ENV if k in env},
        "groups": list(groups or []),
    }
    path = os.path.join(directory, run_id)
    with open(f"{path}.tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(f"{path}.tmp", path)


def forget_launch(run_id: str) -> None:
    """In the caller: the launch ``run_id`` has ended; nothing of it is left to end."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(_launches_dir(multiprocessing.util.get_temp_dir()), run_id))


def rank_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables this module gives every rank on top of ``env`` (the caller's)."""
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return {}
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(multiprocessing.util.get_temp_dir(), _COMPILE_CACHE)
    }


def ready() -> bool:
    """In the caller: whether the forkserver has imported every preload (a rank forked from
    it now starts at once). False while it is still importing them, or not running."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return False
    if os.path.exists(os.path.join(multiprocessing.util.get_temp_dir(), _READY)):
        return True
    # Started by other code with other preloads, or long ago: nothing to wait for.
    from nbtools.launch import _env

    if _env.PRELOAD[-1] not in (getattr(server, "_preload_modules", None) or ()):
        return True
    try:
        import psutil

        return time.time() - psutil.Process(pid).create_time() > _READY_AFTER_S
    except Exception:  # noqa: BLE001 - psutil's errors, or none: take it as ready
        return True


def pause(wait: float = 0.0) -> int | None:
    """In the caller: stop the forkserver's preloading (SIGSTOP) while ranks started
    fresh import what they need on the same cores; its pid, for :func:`resume`.

    None (nothing stopped) unless it has settled, which it does first of all, in
    a fraction of a second (``wait``: the most seconds to wait for that): from
    then on it is continued (PR_SET_PDEATHSIG) and ends as usual should the
    caller die meanwhile.
    """
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return None
    settled = os.path.join(multiprocessing.util.get_temp_dir(), _SETTLED)
    deadline = time.monotonic() + wait
    while not os.path.exists(settled):
        if time.monotonic() >= deadline or not _running(pid):
            return None
        time.sleep(0.005)
    try:
        os.kill(pid, signal.SIGSTOP)
    except OSError:
        return None
    return pid


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def resume(pid: int | None) -> None:
    """In the caller: let a forkserver stopped by :func:`pause` go on; idempotent."""
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


def mark_ready() -> None:
    """Inside the forkserver, after its last preload: say so (:func:`ready`).

    Its objects (the preloaded modules') are frozen out of the garbage collector first:
    every rank forked from here inherits them, and a full collection in a rank (a rank
    healed in place runs one before its function runs again) walks only what the rank
    made itself, and leaves the inherited pages unwritten.
    """
    temp_dir = _temp_dir_of_this_forkserver()
    if temp_dir is None:
        return
    gc.collect()
    gc.freeze()
    if temp_dir:
        # The caller may have exited while the preloads ran (a script that only applied
        # ``@distributed``): its directory is gone, and this forkserver ends on its own.
        with contextlib.suppress(FileNotFoundError), open(os.path.join(temp_dir, _READY), "w"):
            pass


def _temp_dir_of_this_forkserver() -> str | None:
    """The caller's ``pymp-*`` directory when this process is its forkserver, else None."""
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            cmdline = fh.read().decode(errors="replace")
    except OSError:
        return None
    match = re.search(r"from multiprocessing\.forkserver import main; main\((\d+),", cmdline)
    if match is None:
        return None
    try:
        with socket.socket(socket.AF_UNIX, fileno=os.dup(int(match.group(1)))) as listener:
            address = listener.getsockname()
    except OSError:
        return ""
    directory = os.path.dirname(address) if isinstance(address, str) else ""
    return directory if os.path.basename(directory).startswith("pymp-") else ""


def settle() -> None:
    """Inside the forkserver: everything the module docstring lists. Nothing elsewhere."""
    temp_dir = _temp_dir_of_this_forkserver()
    if temp_dir is None:
        return
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    try:  # stopped by pause() when the caller dies: go on, and end as below
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGCONT))
        if temp_dir:
            with open(os.path.join(temp_dir, _SETTLED), "w"):
                pass
    except (OSError, AttributeError):
        pass
    if temp_dir and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        # Read when torch first needs it (its imports below make the directory).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(temp_dir, _COMPILE_CACHE)
    for name in _OPTIONAL_PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    atexit.register(_end, temp_dir, os.getpid())


def _end(temp_dir: str, pid: int) -> None:
    """The forkserver ends (its caller is gone): end the ranks, their launches, the directory."""
    if os.getpid() != pid:
        return  # a rank forked from here ends with os._exit; never runs this
    children = _kill_children()
    _reap(children, _REAP_S)
    if temp_dir:
        _end_launches(_launches_dir(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_children() -> list[int]:
    """SIGKILL every child (a rank) and the process group it leads; their pids."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as fh:
            children = [int(pid) for pid in fh.read().split()]
    except (OSError, ValueError):
        children = []
    for child in children:
        with contextlib.suppress(OSError):
            if os.getpgid(child) == child:
                os.killpg(child, signal.SIGKILL)  # what the rank started, in its group
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    return children


def _reap(children: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(children)
    while pending and time.monotonic() < deadline:
        for child in list(pending):
            try:
                done, _ = os.waitpid(child, os.WNOHANG)
            except ChildProcessError:
                done = child
            if done:
                pending.discard(child)
        if pending:
            time.sleep(0.01)


def _end_launches(directory: str) -> None:
    """Run the launch-end hooks of every launch still recorded, remove their run directories."""
    try:
        names = [n for n in os.listdir(directory) if not n.endswith(".tmp")]
    except OSError:
        return
    from nbtools._internal import hooks

    for run_id in names:
        try:
            with open(os.path.join(directory, run_id)) as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        for pgid in record.get("groups") or []:
            # Ranks this forkserver did not fork (started with "spawn") and what every rank
            # started: the groups outlive their leaders.
            with contextlib.suppress(OSError, TypeError, ValueError):
                os.killpg(int(pgid), signal.SIGKILL)
        for name in _HOOK_ENV:
            os.environ.pop(name, None)
        os.environ.update(record.get("env") or {})
        hooks.launch_ended(run_id)
        run_dir = record.get("run_dir")
        if isinstance(run_dir, str) and os.path.basename(run_dir).startswith("nbtools-"):
            shutil.rmtree(run_dir, ignore_errors=True)


# Preloaded first by the forkserver: settle it before torch's own imports there.
settle()
