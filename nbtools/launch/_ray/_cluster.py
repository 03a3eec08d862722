"""The Ray cluster as a launch sees it: connecting, what it holds, where ranks go.

Checks here run before anything starts, so that a request the cluster cannot
satisfy is one clear error, not a placement group that waits forever.

Placement: one placement group per attempt. Without ``nodes`` each rank is a
bundle of one GPU (or one CPU) and the group is ``PACK`` (as few nodes as Ray
can). With ``nodes=K`` there are K bundles of about ``world/K`` GPUs or CPUs
each, ``STRICT_SPREAD``: exactly K distinct nodes.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from nbtools._internal import settings
from nbtools.errors import LaunchError, MissingDependencyError

__all__ = [
    "Node",
    "import_ray",
    "connect",
    "alive_nodes",
    "check_capacity",
    "split",
    "place",
    "PLACEMENT_TIMEOUT_ENV",
    "node_answers",
]

#: Seconds to wait for the cluster to have the ranks' resources free (default 120).
PLACEMENT_TIMEOUT_ENV = "NBTOOLS_RAY_PLACEMENT_TIMEOUT"
_POLL_S = 0.1
_PROBE_S = 5.0


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster."""

    node_id: str
    ip: str
    host: str
    cpus: int
    gpus: int

    @property
    def label(self) -> str:
        """``host (1a2b3c4d, 10.0.0.5)``: host names and IPs may be shared; the id is not."""
        return f"{self.host} ({self.node_id[:8]}, {self.ip})"


def import_ray() -> Any:
    """The ``ray`` module, or a clear error naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            'cluster="ray" needs Ray, which is not installed in this environment. '
            'Install it with: pip install "nbtools[ray]"'
        ) from exc
    return ray


def connect() -> Any:
    """Ray, connected: the caller's own ``ray.init`` if done, else ``RAY_ADDRESS`` or ``auto``.

    nbtools never starts a cluster by itself: a notebook that meant to use one
    must not silently run on a new single-node Ray instead.

    Raises:
        nbtools.errors.LaunchError: no cluster is reachable.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        _probe(address)
        # Rank output is shipped by nbtools, with [rank N] prefixes and no deduplication.
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(
            f"no Ray cluster is reachable at {address!r}: {exc}. Start one (`ray start --head` "
            "on the head node), set RAY_ADDRESS to its address, or call "
            "ray.init(address=...) before launching."
        ) from exc
    return ray


def _probe(address: str) -> None:
    """Fail within seconds when a ``host:port`` address does not answer.

    ``ray.init`` retries an unreachable GCS for minutes before it gives up.
    """
    if address == "auto" or "://" in address:
        return  # Ray resolves these itself, quickly
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc})") from exc


def alive_nodes(ray: Any) -> list[Node]:
    """Every alive node, in the order Ray lists them."""
    nodes = []
    for entry in ray.nodes():
        if not entry.get("Alive"):
            continue
        resources = entry.get("Resources", {})
        nodes.append(
            Node(
                node_id=entry["NodeID"],
                ip=entry.get("NodeManagerAddress", "?"),
                host=entry.get("NodeManagerHostname", "?"),
                cpus=int(resources.get("CPU", 0)),
                gpus=int(resources.get("GPU", 0)),
            )
        )
    return nodes


def node_answers(ray: Any, node_id: str) -> bool:
    """Whether the node is alive and its raylet accepts a connection now.

    Ray marks a node dead only after its health checks fail, seconds after its
    raylet is gone; a refused connection says so at once.
    """
    for entry in ray.nodes():
        if entry.get("NodeID") != node_id:
            continue
        if not entry.get("Alive"):
            return False
        address, port = entry.get("NodeManagerAddress"), entry.get("NodeManagerPort")
        if not address or not port:
            return True  # nothing to ask: trust Ray's view
        try:
            with socket.create_connection((address, int(port)), timeout=_PROBE_S):
                return True
        except OSError:
            return False
    return False


def split(world_size: int, nodes: int) -> list[int]:
    """Ranks per node for ``nodes`` nodes: as even as possible, larger first."""
    base, extra = divmod(world_size, nodes)
    return [base + (1 if i < extra else 0) for i in range(nodes)]


def check_capacity(ray: Any, world_size: int, use_cuda: bool, nodes: int | None) -> None:
    """Raise ValueError when the cluster, even idle, cannot hold these ranks.

    The message says how many GPUs (or CPUs) exist and on which nodes.
    """
    resource = "GPU" if use_cuda else "CPU"
    option = "gpus" if use_cuda else "processes"
    if nodes is not None and nodes > world_size:
        raise ValueError(
            f"nodes={nodes} is more than the {world_size} ranks ({option}={world_size}); "
            f"every node needs at least one rank. Use nodes={world_size} or fewer."
        )
    alive = alive_nodes(ray)
    have = [(n, n.gpus if use_cuda else n.cpus) for n in alive]
    total = sum(count for _, count in have)
    where = "; ".join(f"{count} on {n.label}" for n, count in have if count) or "none on any node"
    if world_size > total:
        raise ValueError(
            f"{option}={world_size} needs {world_size} {resource}s (one per rank), but the Ray "
            f"cluster has {total}: {where}. Ask for {total} or fewer, or add nodes."
        )
    if nodes is None:
        return
    usable = sorted((count for _, count in have if count), reverse=True)
    if nodes > len(usable):
        raise ValueError(
            f"nodes={nodes} asks for {nodes} nodes with {resource}s, but the Ray cluster has "
            f"{len(usable)}: {where}. Use nodes={len(usable)} or fewer."
        )
    sizes = split(world_size, nodes)
    if any(size > count for size, count in zip(sizes, usable, strict=False)):
        raise ValueError(
            f"{option}={world_size} over nodes={nodes} puts {sizes[0]} ranks on one node, but no "
            f"{nodes} nodes of the Ray cluster have room for {sizes}: {where}. Use more nodes "
            "or fewer ranks."
        )


def place(ray: Any, world_size: int, use_cuda: bool, nodes: int | None) -> tuple[Any, list[int]]:
    """Reserve the ranks' resources; return the placement group and each rank slot's bundle.

    Waits until the cluster has the resources free, at most
    ``NBTOOLS_RAY_PLACEMENT_TIMEOUT`` seconds (default 120).

    Raises:
        nbtools.errors.LaunchError: the resources did not become free in time.
        KeyboardInterrupt: interrupted while waiting (the reservation is removed).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    resource = "GPU" if use_cuda else "CPU"
    if nodes is None:
        sizes, strategy = [1] * world_size, "PACK"
    else:
        sizes, strategy = split(world_size, nodes), "STRICT_SPREAD"
    group = placement_group([{resource: float(n)} for n in sizes], strategy=strategy)
    slots = [bundle for bundle, size in enumerate(sizes) for _ in range(size)]
    timeout = _placement_timeout()
    deadline = time.monotonic() + timeout
    try:
        ready = group.ready()
        while not ray.wait([ready], timeout=_POLL_S)[0]:
            if time.monotonic() > deadline:
                free = ray.available_resources().get(resource, 0)
                raise LaunchError(
                    f"the Ray cluster did not free {world_size} {resource}s for the ranks within "
                    f"{timeout:g} s ({free:g} free now; other work holds the rest). Wait for it "
                    f"to end, or set {PLACEMENT_TIMEOUT_ENV} to wait longer."
                )
    except BaseException:
        remove_placement_group(group)
        raise
    return group, slots


def _placement_timeout() -> float:
    value = settings.read(PLACEMENT_TIMEOUT_ENV)
    return 120.0 if value is None else float(value)
