"""What runs inside each rank: set up, call the user's function, report back.

:func:`run_rank` is the entry point of torch's elastic ``MultiprocessContext``;
it is a module-level function so that the standard pickling of the target works
and the forkserver can preload it. The user's function arrives as cloudpickle
bytes.

A rank that fails writes a failure record (JSON, published atomically) and
exits non-zero, so that the caller sees the exit at once and stops the others.
A rank whose function returned marks that at once (so that a peer failing in a
collective can be explained), leaves the process group, waits until the caller
says every rank has returned, then ends what it left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import faulthandler
import gc
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from nbtools._internal.fs import free_bytes
from nbtools.errors import PicklingError, ResultWriteError
from nbtools.launch import _results
from nbtools.launch._rank import _heal, _inrank, _leftovers, _rank_exit
from nbtools.launch._rank._records import GROUP_PHASE, failure_record, flush_events

__all__ = [
    "RankSpec",
    "run_rank",
    "failure_path",
    "returned_path",
    "release_path",
    "formed_path",
    "leftovers_path",
    "GROUP_PHASE",
    "STACK_SIGNAL",
]

#: Makes a rank print every thread's Python stack to its stderr (``faulthandler``).
STACK_SIGNAL = signal.SIGUSR2
# First and longest pause between looks for the caller's release (all ranks returned).
_RELEASE_POLL_S = (0.0005, 0.05)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs besides the payload."""

    rank: int
    world_size: int
    backend: str
    use_cuda: bool
    init_method: str
    run_dir: str
    caller_pid: int
    env_names: frozenset[str] = field(default_factory=frozenset)
    #: Say when the group has formed (:func:`formed_path`): the caller waits for it.
    report_formed: bool = False
    #: Heal in place when a peer dies (:mod:`._heal`); the group's generation.
    heal: bool = False
    generation: int = 0
    #: A replacement's stdout and stderr: the files its rank's output goes to (appended).
    output: tuple[str, str] | None = None
    #: A spare rank's pipe: it waits there for the slot it takes (:func:`._heal.park`).
    spare: str = ""


def failure_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` publishes its failure record."""
    return os.path.join(run_dir, f"failure-rank{rank}.json")


def returned_path(run_dir: str, rank: int) -> str:
    """Exists once rank ``rank``'s function has returned (its result is ready)."""
    return os.path.join(run_dir, f"returned-rank{rank}")


def formed_path(run_dir: str, rank: int) -> str:
    """Exists once rank ``rank`` is in the formed group (with ``RankSpec.report_formed``)."""
    return os.path.join(run_dir, f"formed-rank{rank}")


def release_path(run_dir: str) -> str:
    """Created by the caller once every rank has returned."""
    return os.path.join(run_dir, "all-returned")


def leftovers_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` lists the processes it left running and that were stopped."""
    return os.path.join(run_dir, f"leftovers-rank{rank}.json")


def run_rank(payload: bytes, spec: RankSpec) -> None:
    """Run the user's function in this rank; its return value goes to the rank's result file.

    torch's elastic result queue carries ``None``: the value itself is pickled
    once, with its large buffers out of band, and the caller reads it from the
    file (:func:`nbtools.launch._results.load`).
    """
    _die_with_parent_chain(spec.caller_pid, os.path.dirname(spec.run_dir))
    if spec.spare:
        _leftovers.lead_own_group()  # the caller ends the spare with its group
        spec = _heal.park(payload, spec)
    if spec.output is not None:
        _append_output(spec.output)
    _mirror_caller_environment(spec.env_names)
    _leftovers.lead_own_group()
    _inrank.private_temp_dir()
    for stream in (sys.stdout, sys.stderr):
        # Output goes to a file the caller tails: line buffering keeps it live.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    current = [spec]  # the rank's spec now: a group that shrank or grew numbers it anew
    try:
        _run(payload, current)
    except BaseException as exc:  # noqa: BLE001 - every way out of user code is reported
        spec = current[0]
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            _publish_result(None, spec)
            _mark_returned(spec)
            _finish(spec)
            return None
        if not os.path.exists(failure_path(spec.run_dir, spec.rank)):
            _publish_failure(spec, exc)
        flush_events()
        sys.stdout.flush()
        sys.stderr.flush()
        # SystemExit passes through torch's wrappers without writing their own error files.
        sys.exit(1)
    flush_events()
    _finish(current[0])
    return None


def _run(payload: bytes, current: list[RankSpec]) -> None:
    spec = current[0]
    fn, args, kwargs = _inrank.enter_rank(
        payload, backend=spec.backend, device=spec.rank if spec.use_cuda else None
    )
    while True:
        _form(spec)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                raise
            # Taken now, while the group is still up: peers fail only once this process goes
            # away (or leaves the group), so the cause's record is always the earliest.
            record = failure_record(spec.rank, exc, skip_file=__file__)
            healed = _heal.after_error(spec, exc) if spec.heal else None
            if healed is None:
                _publish_record(spec, record)
                raise
            spec = current[0] = healed
        else:
            break
        # Healed: the same function object again, in this process, in the new group.
        _inrank.forget_async_save_group()
        _heal.before_rerun()
    _publish_result(result, spec)
    _mark_returned(spec)


def _form(spec: RankSpec) -> None:
    """Form the default process group of ``spec``'s generation, every rank connected."""
    import torch.distributed as dist

    if spec.heal and spec.generation:
        _heal.mark_started(spec)
    try:
        dist.init_process_group(
            backend=spec.backend,
            init_method=spec.init_method,
            rank=spec.rank,
            world_size=spec.world_size,
        )
        # Every rank is connected before any user code runs, so a group that
        # fails to form has had no side effects and may simply be formed again.
        dist.barrier()
    except RuntimeError as exc:
        _publish_failure(spec, exc, phase=GROUP_PHASE)
        raise
    if spec.report_formed:
        with open(formed_path(spec.run_dir, spec.rank), "w"):
            pass
    if spec.heal:
        _heal.mark_formed(spec)


def _append_output(paths: tuple[str, str]) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to the end of ``paths``:
    a replacement writes where the rank it replaces wrote, which the caller still reads."""
    for fd, path, stream in ((1, paths[0], sys.stdout), (2, paths[1], sys.stderr)):
        stream.flush()
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(target, fd)
        os.close(target)


def _mark_returned(spec: RankSpec) -> None:
    """Say that this rank returned, then leave the group (peers still in a collective fail)."""
    with open(returned_path(spec.run_dir, spec.rank), "w"):
        pass
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _finish(spec: RankSpec) -> None:
    """Once every rank has returned: end what this rank left running; tell the caller what.

    The function has returned and its result is published: nothing here makes the rank
    fail. An error is printed, as the interpreter prints one from an exit handler.
    """
    try:
        _end_returned(spec)
    except Exception:  # noqa: BLE001 - reported; the rank's work is done
        print(f"Exception ignored at the end of rank {spec.rank}:", file=sys.stderr)
        traceback.print_exc()


def _end_returned(spec: RankSpec) -> None:
    release = release_path(spec.run_dir)
    delay = _RELEASE_POLL_S[0]
    while not os.path.exists(release):
        # Peers usually return together: look again soon, then back off for a long wait.
        time.sleep(delay)
        delay = min(delay * 2, _RELEASE_POLL_S[1])
    # What the rank's code registered for interpreter exit (W&B ends its wandb-core there).
    _rank_exit.run()
    left = _leftovers.end_rank_leftovers()
    if left:
        with open(leftovers_path(spec.run_dir, spec.rank), "w") as fh:
            json.dump(left, fh)
    # A rank started fresh (``spawn``, while the forkserver still loads) ends through the
    # interpreter's exit, whose collections walk every object torch and the rank's code
    # made: a second or more of the caller's wait. Its work is done and its exit handlers
    # have run; leave those objects out of the walk, as a forked rank's os._exit does.
    gc.freeze()


def _publish_result(result: object, spec: RankSpec) -> None:
    """Leave the return value for the caller, pickled once (see :mod:`._results`).

    A value that cannot be pickled and a file that cannot be written (a full
    ``TMPDIR``) are told apart: the first is the user's value, the second the
    machine's disk, and each message says what to do about it.
    """
    try:
        framed = _results.pack(result)
    except Exception as exc:
        raise PicklingError(_results.unpicklable_message(result, spec.rank, exc)) from exc
    path = _results.result_path(spec.run_dir, spec.rank)
    try:
        _results.write(framed, path)
    except OSError as exc:
        size = _results.framed_size(framed)
        reason = exc.strerror.lower() if exc.strerror else str(exc)
        free = _free_bytes(spec.run_dir)
        free_text = f" ({_human(free)} free)" if free is not None else ""
        advice = (
            "free space in TMPDIR or return less"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "check TMPDIR or return less"
        )
        raise ResultWriteError(
            exc.errno,
            f"rank {spec.rank}: its return value ({_human(size)}) could not be written to "
            f"{spec.run_dir}: {reason}{free_text}; {advice}",
        ) from exc


def _free_bytes(directory: str) -> int | None:
    try:
        return free_bytes(directory)
    except OSError:
        return None


def _human(n: int) -> str:
    """``n`` bytes in the unit a person reads at a glance (decimal, as ``df -H``)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _mirror_caller_environment(names: frozenset[str]) -> None:
    """Drop variables the caller no longer has: the forkserver's environment is older."""
    if not names:
        return
    for name in list(os.environ):
        if name not in names and not name.startswith("TORCHELASTIC_"):
            del os.environ[name]


def _publish_failure(spec: RankSpec, exc: BaseException, phase: str = "") -> None:
    _publish_record(spec, failure_record(spec.rank, exc, phase=phase, skip_file=__file__))


def _publish_record(spec: RankSpec, record: dict) -> None:
    path = failure_path(spec.run_dir, spec.rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)
    except OSError as write_error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        # The record cannot reach the caller (its directory is full): say it on stderr, which
        # the caller shows when it can, and the caller names the full directory on its own.
        print(
            f"rank {spec.rank} failed with {record['exc_type']}: {record['message']} "
            f"(its failure record could not be written to {spec.run_dir}: {write_error})",
            file=sys.__stderr__,
            flush=True,
        )


def _die_with_parent_chain(caller_pid: int, caller_dir: str) -> None:
    """End this rank when the caller (the notebook kernel) is gone.

    A rank's parent is the forkserver, which outlives the kernel while ranks
    hold it open, so the rank watches the caller itself, and removes the run's
    directory that the caller can no longer remove. It ends its process group
    with it (see :mod:`._leftovers`).
    """
    try:  # the forkserver is the direct parent; SIGKILL even if stuck in C code
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    started = _start_time(caller_pid)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if _start_time(caller_pid) != started:
                shutil.rmtree(caller_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    if os.getpgid(0) == os.getpid():
                        os.killpg(0, signal.SIGKILL)  # what it started, in its group, and itself
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="nbtools-caller-watch", daemon=True).start()


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` from /proc (guards against pid reuse), or None when gone.

    A zombie counts as gone: a killed kernel may wait a while to be reaped.
    """
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"
