"""What a pool rank runs: a command loop over the rank's persistent namespace.

:func:`serve` is the function a :class:`~nbtools.launch.RankPool` launches on
every rank, through the same backend and rank set-up as ``@distributed``: by
the time it runs, the environment, device and default process group are in
place. It connects to the kernel (:mod:`nbtools.launch.pool._channel`) and
executes commands until told to stop, then returns, and the rank ends as a
``@distributed`` rank does (group destroyed, leftover children ended).

The namespace is a fresh ``__main__`` module, as in a notebook: classes
defined in cells pickle by value, and code that looks names up in
``__main__`` finds them.

Interrupts. A reader thread receives every frame; an interrupt for the running
command raises ``KeyboardInterrupt`` in the thread running user code (a real
SIGINT in the main thread, so ``time.sleep`` and friends wake up; an
asynchronous exception in a rank that serves from another thread, a Ray
actor's). Outside user code an interrupt is ignored.

No signal wakes a thread other than the main one, and an asynchronous exception
is raised only at the next bytecode, so a rank serving from another thread
gives ``time.sleep`` a stand-in for that thread while it serves: a sleep on a
lock that the interrupt releases (:class:`_WakeableSleep`). An interrupted
``time.sleep`` then ends at once, as it does in the kernel, and the rank's
state is kept.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import linecache
import os
import queue
import signal
import socket
import sys
import threading
import time
import types
from typing import Any

from nbtools.events import _progress
from nbtools.launch import _results
from nbtools.launch._rank import (
    apply_kernel_logging,
    bind_to,
    failure_record,
    figure_bundle,
    flush_events,
    pickle_main_by_value,
)
from nbtools.launch.pool._channel import ChannelClosed, Link, connect
from nbtools.launch.pool._frames import can_open_shared

__all__ = ["serve"]

# How long a healing rank waits for its old link's reader thread to end.
_READER_JOIN_S = 5.0
# What a rank's reply says (second element of a reply).
OK, ERROR, INTERRUPTED = "ok", "error", "interrupted"


def serve(
    address: str | tuple[str, int], key: bytes, use_cuda: bool, kernel_pid: int | None = None
) -> None:
    """Serve the pool's commands on this rank until the kernel says stop or goes away.

    ``kernel_pid``: the kernel's process on this machine, whose memory files large
    pushes come in (:mod:`nbtools.launch.pool._frames`); None for ranks elsewhere.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    shared = isinstance(address, str) and kernel_pid is not None and can_open_shared(kernel_pid)
    hello = {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "shared_memory": shared,
    }
    kept = _KEPT.pop("main", None)  # this process's namespace, kept through a heal
    if kept is not None:
        hello["names"] = _user_names(kept[0].__dict__)
        hello["healed"] = True
    link = connect(address, key, hello)
    server = _Server(link, rank, use_cuda, kept)
    try:
        server.loop()
    except _Heal:
        _KEPT["main"] = (server.main, server.lent)
        # The reader thread waits in a receive on the link: a plain close would leave the
        # connection open under it, and the kernel waiting for this end to go.
        with contextlib.suppress(OSError):
            server.link.sock.shutdown(socket.SHUT_RDWR)
        server.reader.join(timeout=_READER_JOIN_S)
        raise
    finally:
        server.close()


class _Heal(RuntimeError):
    """Raised out of :func:`serve` when the kernel heals the pool in place: the worker forms
    the group again with the replaced ranks (``nbtools.launch._rank``) and calls
    :func:`serve` again in this process, which keeps its namespace (:data:`_KEPT`)."""


#: The namespace (``__main__`` module) a rank keeps while its group forms again after a heal.
_KEPT: dict[str, tuple[types.ModuleType, dict[str, Any]]] = {}


def _user_names(ns: dict[str, Any]) -> list[str]:
    """The names a user's cells made in a namespace (modules and private names left out)."""
    return sorted(
        name
        for name, value in ns.items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


class _Server:
    def __init__(
        self,
        link: Link,
        rank: int,
        use_cuda: bool,
        kept: tuple[types.ModuleType, dict[str, Any]] | None = None,
    ) -> None:
        self.link = link
        self.rank = rank
        self.use_cuda = use_cuda
        self.main = kept[0] if kept is not None else types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = builtins
        self.ns: dict[str, Any] = self.main.__dict__
        # Notebook names a function brought, still unchanged here.
        self.lent: dict[str, Any] = kept[1] if kept is not None else {}
        self._saved_main = sys.modules.get("__main__")
        sys.modules["__main__"] = self.main
        pickle_main_by_value()  # spawn and forkserver children get the cells' names
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: int | None = None  # seq of the command running user code
        self._started = 0  # seq of the last command that began here
        self._early: int | None = None  # an interrupt for a command not begun here yet
        self._thread = threading.get_ident()
        self._in_main = threading.current_thread() is threading.main_thread()
        self._saved_handler: Any = None
        self._positions: tuple[int, int] = (-1, -1)
        self._sleep: _WakeableSleep | None = None
        if self._in_main:
            self._saved_handler = signal.signal(signal.SIGINT, self._on_sigint)
        else:
            self._sleep = _WakeableSleep(self._thread)
        self.reader = threading.Thread(target=self._read, name="nbtools-pool-reader", daemon=True)
        self.reader.start()

    # --- receiving -------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self.link.recv()
            except (ChannelClosed, OSError, EOFError):
                self.inbox.put(None)
                return
            if message[1] == "interrupt":
                self._interrupt(message[0])
            else:
                self.inbox.put(message)

    def _interrupt(self, seq: int) -> None:
        with self._lock:
            if self._running != seq:
                if seq > self._started:
                    self._early = seq  # sent while this rank had not begun it: stop it there
                return  # otherwise already finished: nothing to interrupt
            if self._in_main:
                signal.pthread_kill(self._thread, signal.SIGINT)
            else:
                # Raised at the serving thread's next bytecode; a sleep there ends first.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread), ctypes.py_object(KeyboardInterrupt)
                )
                if self._sleep is not None:
                    self._sleep.wake()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._running is not None:
            raise KeyboardInterrupt

    # --- the loop ----------------------------------------------------------------

    def loop(self) -> None:
        while True:
            try:
                message = self.inbox.get()
                if message is None:
                    return
                seq, op, arg, *setup = message
                if op == "stop":
                    self._reply(seq, OK, None)
                    return
                if op == "heal":
                    raise _Heal(f"rank {self.rank}: the pool heals in place")
                if setup and setup[0]:
                    _setup(setup[0])
                self._reply(seq, *self._handle(seq, op, arg))
            except KeyboardInterrupt:
                continue  # an interrupt that arrived just after the command ended
            except (ChannelClosed, OSError):
                return

    def _handle(self, seq: int, op: str, arg: Any) -> tuple[str, Any]:
        try:
            with self._lock:
                self._running = seq
                self._started = seq
                early = self._early == seq
                if self._early is not None and self._early <= seq:
                    self._early = None  # used now, or for a command that is over
                if self._sleep is not None:
                    self._sleep.arm()
            if op in ("run", "exec"):
                _progress.new_call()  # this call's loop may report batches only
            try:
                if early:
                    raise KeyboardInterrupt  # interrupted before it began on this rank
                value = getattr(self, "_do_" + op)(arg)
            finally:
                with self._lock:
                    self._running = None
        except KeyboardInterrupt as exc:
            return INTERRUPTED, failure_record(self.rank, exc, skip_file=__file__)
        except BaseException as exc:  # noqa: BLE001 - every way out of user code is reported
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                return OK, _dumps(None)
            return ERROR, failure_record(self.rank, exc, skip_file=__file__)
        return OK, value

    def _reply(self, seq: int, kind: str, data: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # the kernel shows this output before the call returns
            except (OSError, ValueError):
                pass
        flush_events()
        self.link.send((seq, kind, data, self._wrote()))

    def _wrote(self) -> bool:
        """Whether this rank's output files grew since the last reply (unknown: True)."""
        try:
            positions = (os.lseek(1, 0, os.SEEK_CUR), os.lseek(2, 0, os.SEEK_CUR))
        except OSError:
            return True
        wrote = positions != self._positions
        self._positions = positions
        return wrote

    # --- commands ------------------------------------------------------------------

    def _do_exec(self, arg: tuple[str, str, str]) -> Any:
        source, filename, want = arg
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename, "exec")
        last = None
        if want != "none" and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), self.ns)  # the user's own cell
        if last is None:
            return None if want == "display" else _dumps(None)
        value = eval(compile(last, filename, "eval"), self.ns)
        if want == "display":
            return _bundle(value)
        return _dumps(value)

    def _do_run(self, payload: bytes) -> _results.Framed:
        import cloudpickle

        fn, args, kwargs = cloudpickle.loads(payload)
        if isinstance(fn, types.FunctionType) and fn.__module__ == "__main__":
            fn = self._bind(fn)
        return _dumps(fn(*args, **kwargs))

    def _do_push(self, framed: _results.Framed) -> _results.Framed:
        names = framed.loads()  # large tensors use the received memory in place
        self.ns.update(names)
        for name in names:
            self.lent.pop(name, None)  # pushed names belong to the rank now
        return _dumps(None)

    def _do_pull(self, names: list[str]) -> _results.Framed:
        missing = [name for name in names if name not in self.ns]
        if missing:
            raise NameError(", ".join(repr(n) for n in missing))
        values = [self.ns[name] for name in names]
        try:
            return _dumps(values)
        except _Unpicklable:
            for name, value in zip(names, values, strict=True):
                _dumps(value, f"{name!r} ({type(value).__qualname__})")
            raise

    def _do_status(self, _: Any) -> dict[str, Any]:
        import psutil

        proc = psutil.Process()
        info: dict[str, Any] = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": proc.create_time(),
            "rss": proc.memory_info().rss,
        }
        torch = sys.modules.get("torch")
        if torch is not None and (self.use_cuda or torch.cuda.is_initialized()):
            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            info.update(
                device=f"cuda:{device}",
                allocated=torch.cuda.memory_allocated(device),
                reserved=torch.cuda.memory_reserved(device),
                device_used=total - free,
                device_total=total,
            )
        return info

    # --- notebook functions ------------------------------------------------------------

    def _bind(self, fn: types.FunctionType) -> types.FunctionType:
        """``fn`` with this rank's namespace as its globals (ipyparallel's ``interactive``).

        Names the function brought from the notebook fill in what the rank does
        not define; they stay for later cells, and a later call replaces them
        with the notebook's newer values unless rank code has rebound them.
        """
        for name, value in fn.__globals__.items():
            if name.startswith("__"):
                continue
            lent = self.lent.get(name, _MISSING)
            if name not in self.ns or (lent is not _MISSING and self.ns[name] is lent):
                self.ns[name] = value
                self.lent[name] = value
        return bind_to(fn, self.ns)

    def close(self) -> None:
        if self._in_main and self._saved_handler is not None:
            signal.signal(signal.SIGINT, self._saved_handler)
        if self._sleep is not None:
            self._sleep.remove()
        if self._saved_main is not None:
            sys.modules["__main__"] = self._saved_main
        self.link.close()


_MISSING = object()


def _setup(setup: dict[str, Any]) -> None:
    """What the kernel changed since the last call, applied before the command runs."""
    if "logging" in setup:
        apply_kernel_logging(setup["logging"])  # logging configured after the pool started


class _WakeableSleep:
    """``time.sleep`` for one thread that an interrupt ends at once; other threads sleep as before.

    Installed as ``time.sleep`` while a rank serves from a thread that is not the
    main one. That thread sleeps by waiting on a held lock with a timeout;
    :meth:`wake` releases the lock. The interrupt's asynchronous exception is set
    before the wake, so the sleeper raises ``KeyboardInterrupt`` as soon as it
    returns, as an interrupted ``time.sleep`` does in the main thread. Code that
    took ``time.sleep`` by name before the rank started keeps the plain one.
    """

    def __init__(self, thread: int) -> None:
        self._thread = thread
        self._lock = threading.Lock()
        self._lock.acquire()  # held: a sleeper waits until its timeout or a wake
        self._real = time.sleep
        time.sleep = self  # type: ignore[assignment]

    def __call__(self, seconds: float) -> None:
        if threading.get_ident() != self._thread:
            return self._real(seconds)
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._lock.acquire(timeout=min(left, threading.TIMEOUT_MAX)):
                return None  # woken: the pending KeyboardInterrupt is raised next

    def arm(self) -> None:
        """Take back a wake that came when nothing slept (before a new command)."""
        self._lock.acquire(blocking=False)

    def wake(self) -> None:
        """End the serving thread's sleep now (its interrupt is already pending)."""
        try:
            self._lock.release()
        except RuntimeError:
            pass  # already released: a second interrupt before the sleeper woke

    def remove(self) -> None:
        """Give ``time.sleep`` back."""
        real = self._real
        if time.sleep is self:
            time.sleep = real


def _dumps(value: Any, what: str = "") -> _results.Framed:
    """``value`` pickled once for the kernel, its large tensors and arrays out of band."""
    try:
        return _results.pack(value)
    except Exception as exc:
        what = what or f"the value ({type(value).__qualname__})"
        where = _results.find_unpicklable(value, "value")
        part = f": {where} cannot be pickled" if where and where[5:6] in ("[", ".") else ""
        raise _Unpicklable(f"{what} cannot be sent to the notebook{part} ({exc})") from exc


class _Unpicklable(TypeError):
    """A value asked for cannot be pickled; the kernel shows it as one line."""


def _bundle(value: Any) -> dict[str, str] | None:
    """What the notebook displays for a cell's last value (formatted here, like ipyparallel).

    A matplotlib figure is a PNG, as the kernel's displayhook shows it, where this
    rank's rich output reaches the cell (``rich_output``).
    """
    if value is None:
        return None
    figure = figure_bundle(value)
    if figure is not None:
        return figure
    bundle = {"text/plain": repr(value)}
    html = getattr(value, "_repr_html_", None)
    if callable(html) and not isinstance(value, type):
        try:
            text = html()
        except Exception:  # noqa: BLE001 - a broken rich repr falls back to text
            text = None
        if isinstance(text, str):
            bundle["text/html"] = text
    return bundle
