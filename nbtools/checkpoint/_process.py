"""Who a process is, across processes and machines: for markers that name their writer.

A process id means the same process only on the same machine and pid namespace,
and only while that process lives (ids are reused): :func:`machine_id` names
the first, :func:`started` (the creation time) tells a reused id apart.
"""

from __future__ import annotations

import os
import socket

import psutil

__all__ = ["machine_id", "started"]


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


def started(pid: int) -> float | None:
    """The creation time of process ``pid``; None when it is gone; -1.0 when it exists but
    cannot be inspected (count it alive)."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:
        return -1.0
