"""Live GPU monitoring: NVML readings, a bounded history, and the notebook pane.

The core (backends, sampler, history) needs only ``nvidia-ml-py``;
:class:`GPUPane` (ipywidgets + plotly) is imported on first use, so
``import nbtools.monitor`` in a worker rank or a script loads no front-end
library.

Example:
    >>> from nbtools.monitor import GPUPane, SimulatedBackend
    >>> pane = GPUPane(backend=SimulatedBackend(num_gpus=4))  # doctest: +SKIP
    >>> pane.status  # doctest: +SKIP
    'polling'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbtools.monitor.backends import Backend, BackendUnavailable, NVMLBackend
from nbtools.monitor.cluster import ClusterBackend
from nbtools.monitor.history import History
from nbtools.monitor.readings import FIELDS, GPUReading, Sample, describe_throttle
from nbtools.monitor.sampler import Sampler, SampleSink, acquire, release
from nbtools.monitor.simulated import SimulatedBackend
from nbtools.monitor.timing import (
    DEFAULT_HISTORY_SECONDS,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_INTERVAL,
    MAX_HISTORY_POINTS,
)

__all__ = [
    "GPUPane",
    "Backend",
    "BackendUnavailable",
    "NVMLBackend",
    "SimulatedBackend",
    "ClusterBackend",
    "History",
    "Sampler",
    "SampleSink",
    "Sample",
    "GPUReading",
    "FIELDS",
    "describe_throttle",
    "acquire",
    "release",
    "DEFAULT_INTERVAL",
    "DEFAULT_HISTORY_SECONDS",
    "DEFAULT_IDLE_TIMEOUT",
    "MAX_HISTORY_POINTS",
]

if TYPE_CHECKING:  # pragma: no cover
    from nbtools.monitor.pane import GPUPane


def __getattr__(name: str) -> Any:
    if name == "GPUPane":
        from nbtools.monitor.pane import GPUPane

        return GPUPane
    raise AttributeError(f"module 'nbtools.monitor' has no attribute {name!r}")
