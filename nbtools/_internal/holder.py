"""Who holds a lease or marker, and whether it still lives: :class:`Holder`.

A file that names its writer (a lease, a save marker, a staging directory)
records the writer's machine, process id and process start time. A process id
means the same process only on the same machine and pid namespace, and only
while that process lives (ids are reused), so all three are needed to answer
"is the writer named here alive?": :meth:`Holder.alive` answers it, with
:attr:`Liveness.UNKNOWN` for a writer on another machine, which only the file's
own heartbeat can tell.

The start time is the one ``psutil.Process.create_time()`` reports (seconds
since the epoch, from ``/proc/<pid>/stat`` and the boot time in ``/proc/stat``),
so records written with either compare equal.
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass
from typing import Any

__all__ = ["Holder", "Liveness", "machine_id", "process_started"]

#: Two start times closer than this are the same process (boot time is whole seconds).
SAME_START_S = 1.0


class Liveness(enum.Enum):
    """The answer of :meth:`Holder.alive`."""

    ALIVE = "alive"
    DEAD = "dead"
    #: On another machine (or pid namespace): a process id says nothing here.
    UNKNOWN = "unknown"


def machine_id() -> str:
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


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime"):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, ValueError):
        return False  # not a process id at all
    return True


def process_started(pid: int) -> float | None:
    """The start time of process ``pid`` in seconds since the epoch, as psutil reports it.

    Returns None when no such process runs (an exited one that is not yet reaped, a
    zombie, counts as gone), and -1.0 when it runs but its start time cannot be read
    (no ``/proc``, or a ``/proc`` that hides other users' processes): count it alive.
    """
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else (-1.0 if _exists(pid) else None)
    except OSError:
        return -1.0 if _exists(pid) else None
    # The command name, in parentheses, may hold spaces and parentheses itself.
    fields = data[data.rfind(b")") + 2 :].split()
    boot = _boot_time()
    try:
        state, ticks = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return -1.0
    if state in (b"Z", b"X"):
        return None
    if boot is None:
        return -1.0
    return ticks / os.sysconf("SC_CLK_TCK") + boot


@dataclass(frozen=True)
class Holder:
    """A process named by a record: its machine, process id and start time.

    Attributes:
        machine: :func:`machine_id` of the machine the process runs on.
        pid: Its process id there.
        started: Its start time (:func:`process_started`); None where the record
            has none, and the process id alone then judges it.
    """

    machine: str
    pid: int
    started: float | None

    @classmethod
    def me(cls) -> Holder:
        """This process."""
        pid = os.getpid()
        return cls(machine_id(), pid, process_started(pid))

    @classmethod
    def from_record(cls, record: Any) -> Holder | None:
        """The holder a record (``machine``, ``pid``, ``started`` keys) names; None if none."""
        if not isinstance(record, dict):
            return None
        pid, machine, started = record.get("pid"), record.get("machine"), record.get("started")
        if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(machine, str):
            return None
        if isinstance(started, bool) or not isinstance(started, (int, float)):
            started = None
        return cls(machine, pid, None if started is None else float(started))

    def record(self) -> dict[str, Any]:
        """The keys a record stores for this holder (the inverse of :meth:`from_record`)."""
        return {"pid": self.pid, "started": self.started, "machine": self.machine}

    @property
    def here(self) -> bool:
        """Whether the holder runs on this machine, in this pid namespace."""
        return self.machine == machine_id()

    def alive(self) -> Liveness:
        """Whether the holder still runs: a reused process id counts as dead.

        Another machine's holder is :attr:`Liveness.UNKNOWN`. A process that runs
        but whose start time cannot be read, and a holder recorded without one,
        count as alive while the process id exists.
        """
        if not self.here:
            return Liveness.UNKNOWN
        now = process_started(self.pid)
        if now is None:
            return Liveness.DEAD
        if now == -1.0 or self.started is None or self.started == -1.0:
            return Liveness.ALIVE
        return Liveness.ALIVE if abs(now - self.started) < SAME_START_S else Liveness.DEAD
