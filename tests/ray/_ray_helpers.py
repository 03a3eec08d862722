"""What the Ray tests check after each test: no nbtools actor, placement group or actor process."""

from __future__ import annotations

import time

import psutil
import ray

_OUR_ACTORS = ("RankActor", "NodeSampler")


def live_actors() -> list[str]:
    """Class names of nbtools actors Ray still counts as alive (or about to be)."""
    from ray._private import state

    names = []
    for info in state.actors().values():
        name = info.get("ActorClassName", "")
        if info.get("State") not in ("DEAD",) and name.endswith(_OUR_ACTORS):
            names.append(f"{name} ({info.get('State')})")
    return names


def live_placement_groups() -> list[str]:
    """Ids of placement groups that are not removed."""
    table = ray.util.placement_group_table()
    return [pid for pid, info in table.items() if info.get("state") != "REMOVED"]


def our_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and any(name in title for name in _OUR_ACTORS):
            found.append(proc)
    return found


def wait_until_clean(timeout: float = 15.0) -> list[str]:
    """Problems still there after ``timeout`` seconds (empty when clean)."""
    deadline = time.monotonic() + timeout
    while True:
        problems = []
        actors = live_actors()
        if actors:
            problems.append(f"actors alive: {actors}")
        groups = live_placement_groups()
        if groups:
            problems.append(f"placement groups not removed: {groups}")
        procs = our_processes()
        if procs:
            problems.append(f"actor processes running: {[p.pid for p in procs]}")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.2)
