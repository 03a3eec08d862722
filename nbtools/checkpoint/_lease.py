"""One writer per checkpoint root: the lease file ``ROOT/.nbtools-writer``.

Two runs saving into one root would delete each other's checkpoints (retention)
and could write into the same step directory, so they are refused. The first
manager to save writes the lease (process id, host, a token) and renews it from
a heartbeat thread until it closes. Another manager that finds a lease:

- takes it over when the holder is this very process (a notebook cell run again
  while the previous manager was never closed) or a process of this machine that
  no longer exists (a crashed or killed run);
- is refused at once when the holder is a live process of this machine;
- for a holder on another machine, watches the lease for a few heartbeats: a
  renewed lease is held (refused), one left unchanged was left by a writer that
  is gone and is taken over. Watching the lease change, rather than comparing
  timestamps, does not depend on the two machines' clocks agreeing.

Writers confirm the lease before each save, so one that lost it stops saving
with a clear error instead of racing the new holder.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

import psutil

from nbtools._internal.log import get_logger
from nbtools.checkpoint._target import Target
from nbtools.errors import CheckpointError

__all__ = ["LEASE_NAME", "WriterLease"]

LEASE_NAME = ".nbtools-writer"
#: Seconds between renewals of a held lease.
HEARTBEAT_S = 10.0
#: A lease of another machine left unchanged this long (by our clock) is abandoned.
WATCH_S = 3 * HEARTBEAT_S
#: A lease older than this by its own timestamp is abandoned whatever the clocks say.
MAX_AGE_S = 3600.0

_log = get_logger("checkpoint")


def _machine() -> str:
    """This machine and pid namespace: where a process id means the same process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:
        return -1.0  # exists but cannot be inspected: treat as alive


def _describe(record: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("since", 0)))
    return f"pid {record.get('pid')} on host {record.get('host')} (writing since {when})"


class WriterLease:
    """The lease of one manager on one root (used on the saving rank only)."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._token = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        self._since = time.time()
        self.held = False
        self.lost_to: dict[str, Any] | None = None
        self._pid = os.getpid()

    @property
    def path(self) -> str:
        """Where the lease file is."""
        return f"{self._target.url}/{LEASE_NAME}"

    # --- file ------------------------------------------------------------------

    def _read(self) -> dict[str, Any] | None:
        try:
            data = self._target.read_bytes(LEASE_NAME)
        except FileNotFoundError:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            return None  # a torn or foreign file: nobody's lease
        return record if isinstance(record, dict) else None

    def _write(self) -> None:
        self._beat += 1
        record = {
            "token": self._token,
            "pid": os.getpid(),
            "started": _started(os.getpid()),
            "host": socket.gethostname(),
            "machine": _machine(),
            "since": self._since,
            "time": time.time(),
            "beat": self._beat,
        }
        self._target.publish_bytes(LEASE_NAME, json.dumps(record).encode())

    # --- taking it --------------------------------------------------------------

    def _refuse(self, record: dict[str, Any]) -> CheckpointError:
        if record.get("machine") == _machine() and record.get("pid") == os.getpid():
            return CheckpointError(
                f"a newer CheckpointManager of this process saves under {self._target.url} "
                "now, so this one does not; close this one and use the newer one"
            )
        return CheckpointError(
            f"another run is saving checkpoints under {self._target.url}: "
            f"{_describe(record)}. Two runs writing one root would delete each other's "
            "checkpoints, so this one does not save. Stop the other run (or close its "
            "CheckpointManager), or give this run its own root. If no such run exists, "
            f"delete {self.path}"
        )

    def _abandoned(self, record: dict[str, Any]) -> bool:
        """Whether the writer of ``record`` is gone (may watch the lease for WATCH_S)."""
        if record.get("machine") == _machine():
            pid = record.get("pid")
            if pid == os.getpid():
                return True  # an earlier manager of this process: superseded
            started = _started(pid) if isinstance(pid, int) else None
            alive = started is not None and (
                started == -1.0
                or record.get("started") is None
                or abs(started - float(record["started"])) < 1.0
            )
            return not alive
        try:
            age = time.time() - float(record.get("time", 0))
        except (TypeError, ValueError):
            return True  # not a lease nbtools wrote
        if age > MAX_AGE_S:
            return True
        _log.warning(
            "%s holds a lease of %s; watching it for %.0f s to see whether that writer is alive",
            self._target.url,
            _describe(record),
            WATCH_S,
        )
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            time.sleep(min(1.0, HEARTBEAT_S / 4))
            now = self._read()
            if now is None:
                return True
            if now != record:
                return False
        return True

    def acquire(self) -> None:
        """Take the lease, or confirm it is still ours.

        Raises:
            CheckpointError: Another live writer holds it, or took it from us.
        """
        with self._lock:
            if self.lost_to is not None:
                raise self._refuse(self.lost_to)
            record = self._read()
            if self.held:
                if record is not None and record.get("token") != self._token:
                    self._lose(record)
                    raise self._refuse(record)
                if record is None:
                    self._write()  # deleted by hand while held: put it back
                return
            if record is not None and not self._abandoned(record):
                raise self._refuse(record)
            if record is not None:
                _log.info("taking over %s from %s, which is gone", self.path, _describe(record))
            self._target.makedirs()
            self._pid = os.getpid()
            self._write()
            mine = self._read()
            if mine is None or mine.get("token") != self._token:  # lost a race to another writer
                raise self._refuse(mine or {})
            self.held = True
            self._thread = threading.Thread(
                target=self._heartbeat, name="nbtools-ckpt-lease", daemon=True
            )
            self._thread.start()

    def _lose(self, record: dict[str, Any]) -> None:
        self.held = False
        self.lost_to = record
        self._stop.set()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if not self.held:
                    return
                try:
                    record = self._read()
                    if record is not None and record.get("token") != self._token:
                        _log.warning(
                            "%s was taken over by %s; this manager saves no more",
                            self.path,
                            _describe(record),
                        )
                        self._lose(record)
                        return
                    self._write()
                except OSError as exc:  # a storage hiccup: the next beat tries again
                    _log.warning("could not renew %s: %s", self.path, exc)

    # --- giving it back -------------------------------------------------------------

    def release(self) -> None:
        """Stop renewing and delete the lease file if it is still ours (idempotent).

        A forked child (a loader worker) shares the token but never releases the
        lease of the process that took it.
        """
        if os.getpid() != self._pid:
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            if not self.held:
                return
            self.held = False
            try:
                record = self._read()
                if record is not None and record.get("token") == self._token:
                    self._target.remove_file(LEASE_NAME)
            except OSError as exc:
                _log.warning("could not remove %s: %s", self.path, exc)
