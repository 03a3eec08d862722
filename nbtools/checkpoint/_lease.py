"""One writer per checkpoint root: the lease file ``ROOT/.nbtools-writer``.

Two runs saving into one root would delete each other's checkpoints (retention)
and could write into the same step directory, so they are refused. The first
manager to save writes the lease (process id and start time, host, a token) and
renews it from a heartbeat thread every :data:`HEARTBEAT_S` until it closes.

What makes a lease live (anything else is taken over at once):

- a holder on this machine (same boot and pid namespace): its process exists,
  started when the lease says (a reused pid does not count), and the lease was
  renewed within :data:`EXPIRE_S` by this machine's clock. A lease without a
  start time or a heartbeat is no evidence of anything;
- a holder on another machine: the lease changes (its heartbeat advances).
  Watching for a change, rather than comparing timestamps, does not depend on
  the two machines' clocks agreeing; only a lease older than :data:`MAX_AGE_S`
  by its own timestamp is abandoned without watching.

The verdict on another writer's lease is :class:`nbtools._internal.lease.LeaseWatch`'s, with
the timings above; the listing lease of a dataset root judges its holders by the same watch.
Watching takes :data:`WATCH_S` and never runs on the training thread: the
manager starts it in the background ahead of the first save (a local root's
lease is read when the manager is created; an object store's from a restore
from the volume or the first ``maybe_save``, and after a recovery from memory
:data:`AFTER_RECOVERY_S` later, so that the store's client, a second of CPU in a
fresh process, does not start beside the recovery's first steps), and a save due before
the verdict is deferred (``maybe_save`` saves at the first step after it) rather
than blocked. A live holder makes every save raise a ``CheckpointError`` naming
it and saying how to take over: ``CheckpointManager(..., takeover=True)``, or
deleting the lease file. Writers confirm the lease before each save, so one that
lost it stops saving with a clear error instead of racing the new holder.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any

from nbtools._internal.holder import machine_id
from nbtools._internal.lease import Heartbeat, LeaseWatch, Verdict, lease_record
from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage import Target
from nbtools.errors import CheckpointError

__all__ = ["AFTER_RECOVERY_S", "LEASE_NAME", "LeasePending", "WriterLease"]

LEASE_NAME = ".nbtools-writer"
#: Seconds between renewals of a held lease.
HEARTBEAT_S = 10.0
#: A lease of this machine not renewed for this long (this machine's clock) is abandoned.
EXPIRE_S = 6 * HEARTBEAT_S
#: A lease of another machine seen unchanged this long (by our clock) is abandoned.
WATCH_S = 3 * HEARTBEAT_S
#: A lease older than this by its own timestamp is abandoned whatever the clocks say.
MAX_AGE_S = 3600.0
#: How often the background watch reads a lease of another machine.
_POLL_S = 1.0
#: After a recovery from memory, how long the probe waits: its first steps run first.
AFTER_RECOVERY_S = 10.0

_log = get_logger("checkpoint")


class LeasePending(CheckpointError):
    """The root's lease belongs to another machine and is still being watched.

    The save is deferred, not refused: ``maybe_save`` saves at the first step
    after the watch ends with the lease abandoned.
    """


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _describe(record: dict[str, Any]) -> str:
    since = _number(record.get("since")) or _number(record.get("time")) or 0.0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    return f"pid {record.get('pid')} on host {record.get('host')} (writing since {when})"


class WriterLease:
    """The lease of one manager on one root (used on the saving rank only).

    Args:
        target: The checkpoint root.
        takeover: Take the lease whatever its state (the other writer, if alive,
            stops saving at its next heartbeat or save).
    """

    def __init__(self, target: Target, takeover: bool = False) -> None:
        self._target = target
        self._takeover = takeover
        self._token = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._stop = threading.Event()  # ends the watch
        self._heartbeat: Heartbeat | None = None
        self._watcher: threading.Thread | None = None
        self._probed = False
        self._not_before = 0.0  # see defer_probe
        self._beat = 0
        self._since = time.time()
        self.held = False
        self.lost_to: dict[str, Any] | None = None
        self._pid = os.getpid()
        # Another writer's lease: a holder of this machine is judged at once (an earlier
        # manager of this process is superseded); another machine's lease is watched.
        self._judge = LeaseWatch(
            quiet_s=WATCH_S, max_age_s=MAX_AGE_S, fresh_local_s=EXPIRE_S, mine_is_gone=True
        )

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
        record = lease_record(
            token=self._token, since=self._since, time=time.time(), beat=self._beat
        )
        self._target.publish_bytes(LEASE_NAME, json.dumps(record).encode())

    # --- judging another writer's lease ----------------------------------------------

    def _refuse(self, record: dict[str, Any]) -> CheckpointError:
        if record.get("machine") == machine_id() and record.get("pid") == os.getpid():
            return CheckpointError(
                f"a newer CheckpointManager of this process saves under {self._target.url} "
                "now, so this one does not; close this one and use the newer one"
            )
        return CheckpointError(
            f"another run is saving checkpoints under {self._target.url}: "
            f"{_describe(record)}, and its lease {self.path} is being renewed. Two runs "
            "writing one root would delete each other's checkpoints, so this one does not "
            "save. Stop the other run (or close its CheckpointManager), or give this run "
            "its own root. If that run is gone, take over with "
            f"CheckpointManager(..., takeover=True) or delete {self.path}"
        )

    def _verdict(self, record: dict[str, Any]) -> Verdict:
        """The verdict on a lease that is not ours."""
        if self._takeover:
            return Verdict.GONE
        return self._judge.judge(
            record, key=record.get("token"), mark=record, written_at=_number(record.get("time"))
        )

    def _pending(self, record: dict[str, Any]) -> LeasePending:
        left = max(0.0, WATCH_S - (time.monotonic() - self._judge.quiet_since))
        return LeasePending(
            f"{self._target.url} holds the writer lease of {_describe(record)}, on another "
            f"machine; watching it for {left:.0f} s more to learn whether that run is alive, "
            "so this save is deferred (the first step after that is saved). To take over at "
            f"once, use CheckpointManager(..., takeover=True) or delete {self.path}"
        )

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            with self._lock:
                if self.held:
                    return
                try:
                    record = self._read()
                except OSError as exc:  # a storage hiccup: the next poll tries again
                    _log.warning("could not read %s: %s", self.path, exc)
                    continue
                if record is None or self._verdict(record) is not Verdict.PENDING:
                    self._watcher = None
                    return

    def _start_watch(self) -> None:
        if self._watcher is None:
            self._stop.clear()
            self._watcher = threading.Thread(
                target=self._watch, name="nbtools-ckpt-lease-watch", daemon=True
            )
            self._watcher.start()

    def probe(self) -> None:
        """Start watching the root's lease in the background when another machine holds it;
        once (later calls do nothing).

        Called ahead of the first save, so that a verdict is usually known by
        then. Errors reading the lease are left to the first save. In an object
        store the read (a request, in a fresh process the client's start too)
        happens in the background: the caller never waits for it.
        """
        if self._probed or time.monotonic() < self._not_before:
            return
        self._probed = True
        if self._target.local_path is None:
            threading.Thread(
                target=self._probe, name="nbtools-ckpt-lease-probe", daemon=True
            ).start()
        else:
            self._probe()

    def defer_probe(self, seconds: float) -> None:
        """Make :meth:`probe` do nothing for ``seconds`` (a save due meanwhile reads the
        lease itself, as :meth:`acquire` always does)."""
        self._not_before = time.monotonic() + seconds

    def _probe(self) -> None:
        with self._lock:
            try:
                record = self._read()
            except OSError:
                return
            if record is not None and not self.held and self._verdict(record) is Verdict.PENDING:
                self._start_watch()

    def settle(self) -> None:
        """Wait (at most :data:`WATCH_S`) until a watch in progress has a verdict."""
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(WATCH_S + 2 * _POLL_S)

    # --- taking it --------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease, or confirm it is still ours; never waits.

        Raises:
            LeasePending: Another machine's lease is still being watched.
            CheckpointError: Another live writer holds it, or took it from us.
        """
        with self._lock:
            if self.lost_to is not None:
                raise self._refuse(self.lost_to)
            if self._watcher is not None and self._judge.watched is not None:
                raise self._pending(self._judge.watched)  # the watch reads the file meanwhile
            record = self._read()
            if self.held:
                if record is not None and record.get("token") != self._token:
                    self._lose(record)
                    raise self._refuse(record)
                if record is None:
                    self._write()  # deleted by hand while held: put it back
                return
            if record is not None and record.get("token") != self._token:
                verdict = self._verdict(record)
                if verdict is Verdict.LIVE:
                    raise self._refuse(record)
                if verdict is Verdict.PENDING:
                    self._start_watch()
                    raise self._pending(record)
                if self._takeover:
                    _log.warning(
                        "taking over %s from %s (takeover=True)", self.path, _describe(record)
                    )
                else:
                    _log.info("taking over %s from %s, which is gone", self.path, _describe(record))
            self._target.makedirs()
            self._pid = os.getpid()
            self._write()
            mine = self._read()
            if mine is None or mine.get("token") != self._token:  # lost a race to another writer
                raise self._refuse(mine or {})
            self.held = True
            self._judge.forget()
            self._heartbeat = Heartbeat(self._renew, HEARTBEAT_S, "nbtools-ckpt-lease").start()

    def _lose(self, record: dict[str, Any]) -> None:
        self.held = False
        self.lost_to = record
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=False)

    def _renew(self) -> bool:
        """One heartbeat: rewrite the lease; False once it is lost."""
        with self._lock:
            if not self.held:
                return False
            try:
                record = self._read()
                if record is not None and record.get("token") != self._token:
                    _log.warning(
                        "%s was taken over by %s; this manager saves no more",
                        self.path,
                        _describe(record),
                    )
                    self._lose(record)
                    return False
                self._write()
            except OSError as exc:  # a storage hiccup: the next beat tries again
                _log.warning("could not renew %s: %s", self.path, exc)
            return True

    # --- giving it back -------------------------------------------------------------

    def release(self) -> None:
        """Stop renewing and watching, and delete the lease file if it is still ours (idempotent).

        A forked child (a loader worker) shares the token but never releases the
        lease of the process that took it.
        """
        if os.getpid() != self._pid:
            return
        self._stop.set()
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
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
