"""Every node of a Ray cluster in one pane: a small sampler actor per node.

:class:`ClusterBackend` is a :class:`~nbtools.monitor.backends.Backend` whose
readings come from many hosts: on each poll of the kernel's
:class:`~nbtools.monitor.sampler.Sampler` it asks one :class:`NodeSampler`
actor per alive node (``num_cpus=0``, pinned to its node by node affinity)
to read NVML there (or the simulated backend), and returns one
:class:`~nbtools.monitor.readings.Sample` per node through
:meth:`ClusterBackend.read_samples`. The kernel keeps the history; the
actors keep nothing. So pausing the pane pauses every node, Refresh reads
every node at once, and closing it kills every actor.

Nodes are told apart by Ray node id: a node's label is its host name, plus
the start of its node id when several nodes share a host name. A node that
joins later gets an actor at the next poll; one that leaves is reported once
(log and ``node_lost`` event) and listed in :attr:`ClusterBackend.gone`.

Example:
    >>> pane = GPUPane(backend=ClusterBackend())               # doctest: +SKIP
    >>> pane = GPUPane(backend=ClusterBackend(simulated=2))    # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.errors import MissingDependencyError
from nbtools.monitor.backends import BackendUnavailable, NVMLBackend
from nbtools.monitor.readings import GPUReading, Sample
from nbtools.monitor.simulated import SimulatedBackend

__all__ = ["ClusterBackend", "NodeSampler", "cluster_backend"]

_log = get_logger("monitor")
# Longest wait for the nodes' readings in one poll; a slower node is skipped this time.
_READ_TIMEOUT_S = 5.0


class NodeSampler:
    """Reads the GPUs of the node it runs on (decorated with ``ray.remote`` when used)."""

    def __init__(self, label: str, simulated: int | None, seed: int) -> None:
        if simulated:
            self._backend: Any = SimulatedBackend(simulated, host=label, seed=seed)
        else:
            self._backend = NVMLBackend(host=label)
        self._message = ""
        try:
            self._backend.open()
        except BackendUnavailable as err:
            self._message = str(err)

    def read(self, now: float) -> tuple[list[GPUReading], str]:
        """This node's readings at ``now``, or ``([], why not)``."""
        if self._message:
            try:
                self._backend.open()
                self._message = ""
            except BackendUnavailable as err:
                return [], str(err)
        try:
            return list(self._backend.read(now)), ""
        except BackendUnavailable as err:
            self._message = str(err)
            return [], self._message

    def source(self) -> str:
        return self._backend.source

    def close(self) -> None:
        self._backend.close()


class ClusterBackend:
    """The GPUs of every node of the Ray cluster this process is connected to.

    Args:
        simulated: Run the simulated backend with this many GPUs on every node
            (demos and tests), instead of NVML.
        address: Ray address when this process is not connected yet
            (default ``RAY_ADDRESS``, else ``auto``).
    """

    host = "ray cluster"

    def __init__(self, simulated: int | None = None, address: str | None = None) -> None:
        if simulated is not None and (not isinstance(simulated, int) or simulated < 1):
            raise ValueError(f"simulated must be a positive number of GPUs, got {simulated!r}")
        self.simulated = simulated
        self.source = "simulated" if simulated else "NVML"
        self.key = f"ray:{address or os.environ.get('RAY_ADDRESS') or 'auto'}:{simulated or 'nvml'}"
        self._address = address
        self._ray: Any = None
        self._actors: dict[str, Any] = {}  # node id -> actor
        self._labels: dict[str, str] = {}  # node id -> label
        #: Labels of nodes that were seen and have left the cluster.
        self.gone: list[str] = []
        self.message = ""
        self._lock = threading.Lock()

    # --- Backend protocol ------------------------------------------------------

    def open(self) -> None:
        """Connect to Ray and start a sampler actor on every alive node."""
        with self._lock:
            if self._ray is None:
                self._ray = _connect(self._address)
            self._sync_nodes()

    def read(self, now: float) -> list[GPUReading]:
        """Readings of the first node only; the sampler uses :meth:`read_samples`."""
        samples = self.read_samples(now)
        return list(samples[0].gpus) if samples else []

    def read_samples(self, now: float) -> list[Sample]:
        """One sample per alive node, read there at ``now``."""
        with self._lock:
            if self._ray is None:
                raise BackendUnavailable("the cluster monitor is closed; call open() first")
            self._sync_nodes()
            ray = self._ray
            refs = {node: actor.read.remote(now) for node, actor in self._actors.items()}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=_READ_TIMEOUT_S)
            ready_set = set(ready)
            samples, problems = [], []
            for node, ref in refs.items():
                if ref not in ready_set:
                    continue
                try:
                    readings, why = ray.get(ref)
                except ray.exceptions.RayError:
                    continue  # the node is going away; the next poll notices
                if why:
                    problems.append(f"{self._labels[node]}: {why}")
                if readings:
                    samples.append(Sample(self._labels[node], now, tuple(readings), self.source))
        if not samples and problems:
            raise BackendUnavailable("no node's GPUs can be read: " + "; ".join(problems))
        return samples

    def close(self) -> None:
        """Kill every sampler actor (idempotent)."""
        with self._lock:
            ray, actors = self._ray, list(self._actors.values())
            self._actors.clear()
            self._ray = None
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - a dead actor or a closed connection: nothing to do
                pass

    # --- nodes ------------------------------------------------------------------

    def nodes(self) -> dict[str, str]:
        """``{node id: label}`` of the nodes being sampled."""
        with self._lock:
            return {n: self._labels[n] for n in self._actors}

    def _sync_nodes(self) -> None:
        ray = self._ray
        alive = [n for n in ray.nodes() if n.get("Alive")]
        alive_ids = {n["NodeID"] for n in alive}
        for node_id in [n for n in self._actors if n not in alive_ids]:
            label = self._labels[node_id]
            del self._actors[node_id]
            self.gone.append(label)
            _log.warning("GPU monitor: node %s left the Ray cluster", label)
            _emit_lost(label, node_id)
        hosts: dict[str, int] = {}
        for entry in alive:
            host = entry.get("NodeManagerHostname") or "?"
            hosts[host] = hosts.get(host, 0) + 1
        for index, entry in enumerate(alive):
            node_id = entry["NodeID"]
            if node_id in self._actors:
                continue
            host = entry.get("NodeManagerHostname") or "?"
            label = f"{host} · {node_id[:8]}" if hosts[host] > 1 else host
            self._labels[node_id] = label
            self._actors[node_id] = (
                _actor_class(ray)
                .options(
                    num_cpus=0,
                    scheduling_strategy=_pin(node_id),
                    name=None,
                )
                .remote(label, self.simulated, index)
            )


def cluster_backend(cluster: str, simulated: int | None = None) -> ClusterBackend:
    """The backend behind ``GPUPane(cluster=...)`` and ``%gpu_pane --cluster ...``.

    Raises:
        ValueError: ``cluster`` is not an engine nbtools knows (only ``"ray"``).
    """
    if cluster != "ray":
        raise ValueError(f"cluster must be 'ray' (the only engine nbtools knows), got {cluster!r}")
    return ClusterBackend(simulated=simulated)


_sampler_class: Any = None


def _actor_class(ray: Any) -> Any:
    global _sampler_class
    if _sampler_class is None:
        _sampler_class = ray.remote(max_restarts=0)(NodeSampler)
    return _sampler_class


def _pin(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def _connect(address: str | None) -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            "the cluster GPU pane needs Ray, which is not installed here: "
            'pip install "nbtools[ray]"'
        ) from exc
    if not ray.is_initialized():
        target = address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=target, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise BackendUnavailable(
                f"no Ray cluster is reachable at {target!r} ({exc}); start one or call "
                "ray.init(address=...) first"
            ) from exc
    return ray


def _emit_lost(label: str, node_id: str) -> None:
    try:
        from nbtools import events

        events.emit("node_lost", f"node {label} left the Ray cluster", node=node_id[:16])
    except Exception:  # noqa: BLE001 - the pane goes on without the event
        _log.debug("could not record the node_lost event", exc_info=True)
