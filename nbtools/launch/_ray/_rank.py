"""What runs in each Ray rank actor: capture output, form the group, call the function.

One actor is one rank: a Ray worker process holding one GPU (or one CPU) of a
placement group bundle. The kernel drives it with a few method calls:

- :meth:`RankActor.where` says on which node it is and which GPUs Ray gave it,
  so that the kernel can order ranks by node, then GPU;
- rank 0's :meth:`RankActor.host_store` starts the ``TCPStore`` listening on
  its node's Ray IP only, on a port the OS picks (no race for a "free" port);
- :meth:`RankActor.run` sets the rank's environment, joins the default group
  and calls the function; it returns the result, or the failure record, never
  raises;
- :meth:`RankActor.ask_collectives` passes on the kernel's question on a
  hang: the rank's events thread answers with its Flight Recorder position;
- :meth:`RankActor.end_run`, once every rank returned, runs the launch-end
  hooks on the rank's node (the backend keeps the actors until then);
- :meth:`RankActor.output` is polled by the kernel while ``run`` works (the
  actor is threaded): it returns what the rank wrote to its stdout/stderr and
  the events it emitted since the previous call. Output is captured at the
  file-descriptor level into files on the node, so C-level prints are kept,
  nothing blocks when the kernel is slow, and Ray's own log streaming (with its
  prefixes and deduplication) never sees it.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from nbtools.launch._rank import (
    GROUP_PHASE,
    end_rank_leftovers,
    enter_rank,
    failure_record,
    lead_own_group,
)
from nbtools.launch._ray import _ray_compat

__all__ = ["RankActor", "OUTPUT_CHUNK"]

#: Most bytes of one stream returned by one :meth:`RankActor.output` call.
OUTPUT_CHUNK = 1 << 20
# Lines Ray writes into a worker's streams to tag them for its own log streaming.
_RAY_MARKERS = (b":actor_name:", b":task_name:", b":job_id:")
_STORE_TIMEOUT_S = 300.0


class RankActor:
    """One rank on a Ray node (decorated with ``ray.remote`` by the backend)."""

    def __init__(self) -> None:
        lead_own_group()  # what the rank starts can be found and ended
        # Unlinked at once: a killed actor leaves no file behind on its node.
        self._files = [tempfile.TemporaryFile(buffering=0) for _ in range(2)]
        self._offsets = [0, 0]
        self._dir: str | None = None
        self._done = threading.Event()
        self._changed = threading.Condition()
        self._events: list[tuple[Any, ...]] = []
        self._collector: Any = None
        self._store: Any = None
        self._saved_fds: tuple[int, int] | None = None
        # torch takes seconds to import: start now, while the kernel places the other ranks
        # and rank 0 starts the store (``run`` then finds it loaded, or waits for it).
        threading.Thread(target=_preload, name="nbtools-rank-preload", daemon=True).start()

    # --- placement -----------------------------------------------------------

    def where(self) -> dict[str, Any]:
        """Node id, node IP, host name, pid and the GPU ids Ray assigned to this actor."""
        import socket

        import ray

        context = ray.get_runtime_context()
        gpus = context.get_accelerator_ids().get("GPU", [])
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in gpus],
        }

    def host_store(self, world_size: int) -> tuple[str, int]:
        """Start the group's ``TCPStore`` here (rank 0); return its address and port.

        The store has no authentication, so it listens on the node's Ray
        address only (torch's own listener takes every interface): on a socket
        bound here, handed to the store, which owns it from then on.
        """
        import socket

        import ray
        from torch.distributed import TCPStore

        ip = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        try:
            listening.bind((ip, 0))
            listening.listen(world_size + 16)
            port = listening.getsockname()[1]
        except BaseException:
            listening.close()
            raise
        self._store = TCPStore(
            ip,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=_STORE_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=listening.detach(),
            use_libuv=True,
        )
        return ip, self._store.port

    # --- the rank --------------------------------------------------------------

    def run(self, payload: bytes, spec: dict[str, Any]) -> dict[str, Any]:
        """Run the function as rank ``spec['rank']``; a dict with the result or the failure."""
        timings = {"start": time.time()}
        os.environ.update(spec["env"])
        self._capture()
        try:
            self._start_events()
            faulthandler.enable(file=sys.stderr, all_threads=True)
            try:
                blob = self._call(payload, spec, timings)
            except BaseException as exc:  # noqa: BLE001 - every way out of user code is reported
                if isinstance(exc, SystemExit) and exc.code in (0, None):
                    return {"ok": None, "timings": timings, "left": self._end_leftovers()}
                phase = GROUP_PHASE if "group" not in timings else ""
                record = failure_record(spec["rank"], exc, phase=phase, skip_file=__file__)
                return {"failure": record, "timings": timings}
            timings["returned"] = time.time()
            return {"ok": blob, "timings": timings, "left": self._end_leftovers()}
        finally:
            self._stop_events()
            self._release()

    def _call(self, payload: bytes, spec: dict[str, Any], timings: dict[str, float]) -> bytes:
        import cloudpickle
        import torch.distributed as dist

        fn, args, kwargs = enter_rank(
            payload, backend=spec["backend"], device=spec["device"], exit_handlers=False
        )
        timings["loaded"] = time.time()
        store = self._store
        if store is None:
            store = dist.TCPStore(
                spec["store"][0],
                spec["store"][1],
                spec["world_size"],
                is_master=False,
                timeout=timedelta(seconds=_STORE_TIMEOUT_S),
            )
        dist.init_process_group(
            backend=spec["backend"], store=store, rank=spec["rank"], world_size=spec["world_size"]
        )
        # Every rank is connected before user code runs: a group that fails to
        # form has had no side effects and may simply be formed again.
        dist.barrier()
        timings["group"] = time.time()
        result = fn(*args, **kwargs)
        timings["function"] = time.time()
        try:
            blob = cloudpickle.dumps(result)
        except Exception as exc:
            from nbtools.errors import PicklingError
            from nbtools.launch._results import unpicklable_message

            raise PicklingError(unpicklable_message(result, spec["rank"], exc)) from exc
        if dist.is_initialized():
            dist.destroy_process_group()
        return blob

    def _end_leftovers(self) -> list[str]:
        return end_rank_leftovers()

    # --- output and events -------------------------------------------------------

    def _capture(self) -> None:
        """Point fds 1 and 2 at this rank's files (C-level writes included)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._saved_fds = (os.dup(1), os.dup(2))
        for fd, file in zip((1, 2), self._files, strict=True):
            os.dup2(file.fileno(), fd)
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)

    def _release(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if self._saved_fds is not None:
            for fd, saved in zip((1, 2), self._saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
            self._saved_fds = None
        with self._changed:
            self._done.set()
            self._changed.notify_all()

    def _start_events(self) -> None:
        """Receive the events of this rank and its children here; :meth:`output` ships them."""
        from nbtools.events import Bus, Collector

        actor = self

        class _Relay(Bus):
            def publish(self, events, *, dropped=0, source=None):
                with actor._changed:
                    actor._events.append((list(events), dropped, source))
                    actor._changed.notify_all()

        self._dir = tempfile.mkdtemp(prefix="nbtools-rank-events-", dir=_scratch_root())
        self._collector = Collector(self._dir, bus=_Relay()).start()
        os.environ.update(self._collector.environment())

    def _stop_events(self) -> None:
        if self._collector is not None:
            from nbtools import events

            events.flush()
            self._collector.stop()
            self._collector = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def output(self, wait: float) -> tuple[bytes, bytes, list, bool]:
        """New stdout and stderr bytes and events since the last call.

        Waits up to ``wait`` seconds for something new. The last element is
        True once ``run`` has ended and everything was returned.
        """
        deadline = time.monotonic() + wait
        while True:
            done = self._done.is_set()
            out, err = self._read(0), self._read(1)
            with self._changed:
                shipped, self._events = self._events, []
            if out or err or shipped or done:
                finished = done and len(out) < OUTPUT_CHUNK and len(err) < OUTPUT_CHUNK
                return out, err, shipped, finished
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", b"", [], False
            with self._changed:
                self._changed.wait(min(left, 0.05))

    def _read(self, index: int) -> bytes:
        data = os.pread(self._files[index].fileno(), OUTPUT_CHUNK, self._offsets[index])
        if not self._done.is_set() and len(data) < OUTPUT_CHUNK:
            cut = data.rfind(b"\n") + 1 if b"\n" in data else 0
            if data and cut == 0 and b"\r" not in data:
                return b""  # half a line: wait for the rest (Ray markers are whole lines)
            if cut:
                tail = data[cut:]
                if b"\r" not in tail:
                    data = data[:cut]
        self._offsets[index] += len(data)
        if any(m in data for m in _RAY_MARKERS):
            data = b"".join(
                line for line in data.splitlines(keepends=True) if not line.startswith(_RAY_MARKERS)
            )
        return data

    def ask_collectives(self) -> bool:
        """Ask this rank which collective it is in (a hang report); the answer is an event."""
        collector = self._collector
        return collector.ask() if collector is not None else False

    def stacks(self) -> None:
        """Print every thread's Python stack to this rank's stderr."""
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    # --- the launch's end ---------------------------------------------------------

    def end_run(self, run_id: str, imported_only: bool = False) -> None:
        """Run the launch-end hooks for ``run_id`` on this node, once the launch has ended
        for good, with the rank's environment; ``imported_only``: only those of the
        packages this rank's code imported (the launch's only attempt: no other process
        of it ran here)."""
        from nbtools._internal import hooks

        hooks.launch_ended(run_id, imported_only=imported_only)


def _preload() -> None:
    try:
        import cloudpickle  # noqa: F401
        import torch.distributed  # noqa: F401
    except Exception:  # noqa: BLE001 - ``run`` imports them again and reports what fails
        pass


def _scratch_root() -> str:
    """Ray's session directory on this node (a killed actor's leftovers stay inside it)."""
    return _ray_compat.session_dir() or tempfile.gettempdir()
