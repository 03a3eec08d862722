"""The GPU pane over a Ray cluster: one sampler actor per node, every node in one pane."""

from __future__ import annotations

import time

import pytest
from _ray_helpers import live_actors

from nbtools.monitor import GPUPane
from nbtools.monitor.cluster import ClusterBackend

pytestmark = pytest.mark.slow


def test_pane_shows_every_node_and_follows_nodes_joining_and_leaving(ray_cluster):
    backend = ClusterBackend(simulated=2)
    pane = GPUPane(backend=backend, interval=3600, idle_timeout=None, display=False)
    try:
        labels = sorted(backend.nodes().values())
        assert len(labels) == 4  # the head and the three worker nodes
        # Every node shares the host name here, so labels carry the node id.
        assert len(set(labels)) == 4 and all(" · " in label for label in labels)
        # The first poll asks every node's sampler actor; on a busy machine one that is
        # still starting answers on a later poll (Refresh), as in the live pane.
        for _ in range(30):
            if sorted(pane.sampler.samples.hosts()) == labels:
                break
            time.sleep(1)
            pane.refresh()
        assert sorted(pane.sampler.samples.hosts()) == labels
        columns = pane.sampler.samples.columns()
        assert {(h, g) for h, g in zip(columns["host"], columns["gpu"], strict=True)} == {
            (label, gpu) for label in labels for gpu in (0, 1)
        }
        assert len(live_actors()) == 4  # one sampler per node

        pane.pause()
        assert pane.status == "paused"
        pane.resume()
        extra = ray_cluster.cluster.add_node(num_cpus=0, node_ip_address="127.0.0.1")
        ray_cluster.cluster.wait_for_nodes()
        pane.refresh()
        assert len(backend.nodes()) == 5
        joined = (set(backend.nodes().values()) - set(labels)).pop()
        for _ in range(30):  # the new node's sampler actor may still be starting
            if joined in pane.sampler.samples.hosts():
                break
            time.sleep(1)
            pane.refresh()
        assert joined in pane.sampler.samples.hosts()
        ray_cluster.cluster.remove_node(extra, allow_graceful=False)

        deadline = time.monotonic() + 60
        while joined not in backend.gone and time.monotonic() < deadline:
            pane.refresh()
            time.sleep(0.5)
        assert backend.gone == [joined]
        assert joined not in backend.nodes().values()
    finally:
        pane.close()
    assert pane.status == "closed"
