"""A rank's side of healing in place: wait for the caller's verdict, then form the group again.

With ``@distributed(heal=True)`` a rank whose peer died (a signal, the OOM
killer, ``os._exit``) is not stopped. Its pending collective fails (gloo: the
dead peer's socket closed), the user's function unwinds through its context
managers, and :func:`after_error` then:

1. aborts every process group of the rank, so that peers still blocked in a
   collective with it fail at once too (a ring all-reduce waits on a neighbour,
   not on the dead rank);
2. says it is waiting (:func:`waiting_path`) and waits for the caller's verdict
   on this generation of the group (:func:`verdict_path`): the caller writes
   ``heal`` once it has seen a rank die without a word and has started its
   replacement, ``fail`` when no rank died (every rank that has not returned is
   waiting: the error was the user's own);
3. on ``heal``: shuts down its connections to the other ranks (an aborted gloo
   group keeps them open while anything refers to it, and a peer blocked in a
   collective on one would wait for its timeout), then moves the rank to the next generation: a new rendezvous store
   (no stale keys), ``TORCHELASTIC_RESTART_COUNT`` the new attempt (what
   ``nbtools.runtime.get_restart_count()`` reads), and the variables that tell
   a ``CheckpointManager`` which ranks were replaced (:data:`GENERATION_ENV`,
   :data:`REPLACED_ENV`), so that its restore takes the state the survivors
   still hold (``nbtools.checkpoint._live``).

A spare rank (:func:`park`) is a process started ahead of need from the
forkserver: it imports the modules the ranks' function refers to, then waits on a
pipe for the slot it takes (the dead rank's environment and place in the group)
and runs from there as a replacement started then would.

The worker (:mod:`._worker`) then forms the group again and calls the same
function object again in this process. A rank whose function raised anything
but a ``RuntimeError`` (what torch's collectives raise) fails as without
healing: the same code would raise again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import os
import pickletools
import socket
import time
import traceback
from typing import Any

# ``spec`` below is the worker's ``RankSpec`` (``_worker`` imports this module).
RankSpec = Any

__all__ = [
    "GENERATION_ENV",
    "REPLACED_ENV",
    "DIR_ENV",
    "TARGET_ENV",
    "grow_path",
    "VERDICT_WAIT_S",
    "store_path",
    "waiting_path",
    "verdict_path",
    "generation_formed_path",
    "started_path",
    "write_verdict",
    "read_verdict",
    "after_error",
    "before_rerun",
    "heal_environment",
    "mark_formed",
    "mark_started",
    "park",
    "preload",
    "rank_variables",
]

#: The group's generation: 0 as started, one more after each heal (set in every rank).
GENERATION_ENV = "NBTOOLS_HEAL_GENERATION"
#: The ranks replaced by the last heal, comma-separated (empty in generation 0).
REPLACED_ENV = "NBTOOLS_HEAL_REPLACED"
#: The launch's directory, where each rank keeps its latest per-rank state for a heal.
DIR_ENV = "NBTOOLS_HEAL_DIR"
#: The world size the group was started with: a group that shrank grows back to it.
TARGET_ENV = "NBTOOLS_HEAL_TARGET"
#: The longest a rank waits for the caller's verdict before it fails as without healing (the
#: caller may first try twice to start a replacement in a group that may shrink).
VERDICT_WAIT_S = 60.0
_POLL_S = (0.001, 0.02)
# Stands for cloudpickle's ``subimport`` in :func:`preload`'s memo of the pickle.
_SUBIMPORT = "\0subimport"


def heal_environment(run_dir: str, world_size: int) -> dict[str, str]:
    """What every rank of a group that heals starts with (generation 0, nothing replaced)."""
    return {DIR_ENV: run_dir, GENERATION_ENV: "0", REPLACED_ENV: "", TARGET_ENV: str(world_size)}


def grow_path(run_dir: str, generation: int) -> str:
    """Exists while the caller asks the ranks of generation ``generation`` to stop at their next
    ``maybe_save``, so that the group grows back (``nbtools.checkpoint._live`` names it too)."""
    return os.path.join(run_dir, f"heal-grow-g{generation}")


def store_path(run_dir: str, generation: int) -> str:
    """The rendezvous store of one generation of the group (generation 0: ``store``)."""
    return os.path.join(run_dir, "store" if generation == 0 else f"store-g{generation}")


def waiting_path(run_dir: str, generation: int, rank: int) -> str:
    """Exists while rank ``rank`` of generation ``generation`` waits for the verdict."""
    return os.path.join(run_dir, f"heal-waiting-g{generation}-rank{rank}")


def verdict_path(run_dir: str, generation: int) -> str:
    """The caller's verdict on generation ``generation`` (JSON: ``heal``, ``attempt``, ...)."""
    return os.path.join(run_dir, f"heal-verdict-g{generation}.json")


def generation_formed_path(run_dir: str, generation: int, rank: int) -> str:
    """Exists once rank ``rank`` is in the formed group of generation ``generation``."""
    return os.path.join(run_dir, f"heal-formed-g{generation}-rank{rank}")


def started_path(run_dir: str, generation: int, rank: int) -> str:
    """Exists once rank ``rank``'s process of generation ``generation`` has started (its
    function unpickled) and is about to join the group: a replacement's slot works."""
    return os.path.join(run_dir, f"heal-started-g{generation}-rank{rank}")


def write_verdict(run_dir: str, generation: int, verdict: dict[str, Any]) -> None:
    """Publish the verdict on ``generation`` atomically (the caller's side)."""
    path = verdict_path(run_dir, generation)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(verdict, fh)
    os.replace(tmp, path)


def read_verdict(run_dir: str, generation: int) -> dict[str, Any] | None:
    """The verdict on ``generation``, or None while there is none."""
    try:
        with open(verdict_path(run_dir, generation)) as fh:
            return dict(json.load(fh))
    except FileNotFoundError:
        return None


def mark_formed(spec: RankSpec) -> None:
    """Say that this rank is in the formed group of its generation."""
    with open(generation_formed_path(spec.run_dir, spec.generation, spec.rank), "w"):
        pass


def mark_started(spec: RankSpec) -> None:
    """Say that this rank's process has started and joins the group of its generation."""
    with open(started_path(spec.run_dir, spec.generation, spec.rank), "w"):
        pass


def after_error(spec: RankSpec, exc: BaseException) -> RankSpec | None:
    """After the user's function raised ``exc``: this rank's spec for the next generation when
    the caller heals the group, else None (the rank fails as without healing)."""
    if not isinstance(exc, RuntimeError):
        return None
    _leave_groups(exc)
    waiting = waiting_path(spec.run_dir, spec.generation, spec.rank)
    with open(waiting, "w"):
        pass
    try:
        verdict = _await_verdict(spec)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(waiting)
    if verdict is None or not verdict.get("heal"):
        return None
    _cut_links([int(p) for p in verdict.get("pids", ()) if int(p) != os.getpid()])
    generation = int(verdict["generation"])
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(int(verdict["attempt"]))
    os.environ[GENERATION_ENV] = str(generation)
    os.environ[REPLACED_ENV] = ",".join(str(r) for r in verdict["replaced"])
    rank, world = spec.rank, spec.world_size
    if "world_size" in verdict:  # the group shrank or grew: ranks numbered densely again
        rank = int(verdict["ranks"][str(spec.rank)])
        world = int(verdict["world_size"])
        renumber(rank, world)
    return dataclasses.replace(
        spec,
        rank=rank,
        world_size=world,
        generation=generation,
        init_method="file://" + store_path(spec.run_dir, generation),
    )


def rank_variables(rank: int, world_size: int) -> dict[str, str]:
    """The rank variables torchrun sets for rank ``rank`` of ``world_size`` on one node."""
    names = {name: str(rank) for name in ("RANK", "LOCAL_RANK", "ROLE_RANK")}
    names.update(
        (name, str(world_size)) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")
    )
    return names


def renumber(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of ``world_size`` in its variables (what
    ``nbtools.runtime`` reads before the group forms)."""
    os.environ.update(rank_variables(rank, world_size))


def before_rerun() -> None:
    """Free what the unwound call held (its frames, a manager not closed) before the next."""
    gc.collect()


def _leave_groups(exc: BaseException) -> None:
    """Abort every process group this rank is in: peers blocked with it fail at once.

    The frames of the unwound call go first: a collective's frame still holds its work
    and, through it, the group's connections, which stay open while anything refers
    to them.
    """
    from nbtools import _torch_compat

    traceback.clear_frames(exc.__traceback__)
    with contextlib.suppress(Exception):
        _torch_compat.abort_groups()


def _cut_links(peers: list[int]) -> None:
    """Shut down this process's TCP connections to the other ranks' processes ``peers``.

    An aborted gloo group keeps its connections open as long as anything still refers
    to its context (a collective's work, torch's record of collectives): a peer blocked
    in a collective with this rank would wait for its timeout (30 minutes). Shutting
    them down (the descriptors stay gloo's) makes that peer's collective fail at once.
    Only connections whose other end belongs to a rank are touched.
    """
    mine: dict[str, int] = {}
    for fd in _fds(os.getpid()):
        target = _link(f"/proc/self/fd/{fd}")
        if target.startswith("socket:["):
            mine[target[8:-1]] = fd
    if not mine or not peers:
        return
    theirs = set()
    for pid in peers:
        for fd in _fds(pid):
            target = _link(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                theirs.add(target[8:-1])
    table = _tcp_table()
    inode_of = {(local, remote): inode for local, remote, _, inode in table}
    for local, remote, state, inode in table:
        if state != "01" or inode not in mine:  # 01: ESTABLISHED
            continue
        if inode_of.get((remote, local)) in theirs:
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=mine[inode])
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.detach()  # the descriptor stays open: it is gloo's to close


def _fds(pid: int) -> list[int]:
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/fd")]
    except (OSError, ValueError):
        return []


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _tcp_table() -> list[tuple[str, str, str, str]]:
    """This network namespace's TCP sockets: (local, remote, state, inode)."""
    rows = []
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10:
                rows.append((fields[1], fields[2], fields[3], fields[9]))
    return rows


def _await_verdict(spec: RankSpec) -> dict[str, Any] | None:
    deadline = time.monotonic() + VERDICT_WAIT_S
    delay = _POLL_S[0]
    while time.monotonic() < deadline:
        verdict = read_verdict(spec.run_dir, spec.generation)
        if verdict is not None:
            return verdict
        time.sleep(delay)
        delay = min(delay * 2, _POLL_S[1])
    return None


def park(payload: bytes, spec: RankSpec) -> RankSpec:
    """In a spare rank: import what ``payload``'s function needs (:func:`preload`), then wait
    on the pipe ``spec.spare`` for the slot this process takes; the spec of the rank it is.

    The caller writes the rank's environment and place (JSON) and closes the pipe. It
    never writes to a spare it no longer needs: it ends it (SIGKILL), and a spare whose
    caller is gone ends as every rank does (its parent watch).
    """
    preload(payload)
    fd = os.open(spec.spare, os.O_RDONLY)  # blocks until the caller opens it to write
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    take = json.loads(b"".join(chunks))
    env: dict[str, str] = take["env"]
    os.environ.update(env)
    return dataclasses.replace(
        spec,
        rank=int(take["rank"]),
        world_size=int(take["world_size"]),
        generation=int(take["generation"]),
        init_method=str(take["init_method"]),
        output=(str(take["output"][0]), str(take["output"][1])),
        env_names=spec.env_names | frozenset(env),
        report_formed=False,
        spare="",
    )


def preload(payload: bytes) -> list[str]:
    """Import the modules ``payload`` (a cloudpickle of the ranks' call) refers to, without
    unpickling it: no code of the user's runs here, and its objects are made only once the
    process is a rank. The modules imported (errors are skipped: the rank meets them)."""
    modules: list[str] = []
    strings: list[str] = []  # every string pushed, in order (memo lookups resolved)
    memo: dict[int, str | None] = {}
    last: str | None = None  # the string the last op pushed, if it pushed one
    subimport = False  # the next string names a module (cloudpickle's ``subimport``)
    try:
        for op, arg, _ in pickletools.genops(payload):
            name = op.name
            if name == "MEMOIZE":
                memo[len(memo)] = last
                continue
            if name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = last  # type: ignore[arg-type]
                continue
            value = arg if isinstance(arg, str) and "UNICODE" in name else None
            if name in ("BINGET", "LONG_BINGET", "GET"):
                value = memo.get(int(arg))  # type: ignore[arg-type]
                if value is _SUBIMPORT:  # the memoized ``subimport`` again
                    subimport, last = True, value
                    continue
            last = value
            if value is not None:
                if subimport:
                    modules.append(value)
                    subimport = False
                strings.append(value)
            elif name == "STACK_GLOBAL" and len(strings) >= 2:
                modules.append(strings[-2])
                subimport = strings[-1] == "subimport" and strings[-2].startswith("cloudpickle")
                last = _SUBIMPORT if subimport else None
            elif name == "GLOBAL" and isinstance(arg, str):
                modules.append(arg.split(" ", 1)[0])
    except Exception:  # noqa: BLE001 - a payload it cannot read is unpickled later anyway
        pass
    done = []
    for module in dict.fromkeys(modules):
        if module == "__main__" or not module or module.startswith("__"):
            continue
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the rank's own unpickling reports it
            continue
        done.append(module)
    return done
