"""GPU samples from ``nbtools.monitor`` as MLflow system metrics (off unless asked for).

Names follow MLflow's own system metrics (``system/gpu_0_utilization_percentage``,
``system/gpu_0_memory_usage_megabytes``), so runs logged by nbtools and by
``mlflow.start_run(log_system_metrics=True)`` chart the same way. GPUs of another
host (multi-node runs) go under ``system/node_<host>/``.

Example:
    >>> sink = SystemMetricsSink(logger)           # doctest: +SKIP
    >>> pane.sampler.add_sink(sink)                 # every poll is logged  # doctest: +SKIP
"""

from __future__ import annotations

import socket
import time
from typing import Any

from nbtools.tracking.mlflow import MlflowLogger

__all__ = ["SystemMetricsSink"]

# (attribute of a GPU reading, MLflow metric suffix, scale)
_FIELDS = (
    ("utilization", "utilization_percentage", 1.0),
    ("memory_used", "memory_usage_megabytes", 1e-6),
    ("temperature", "temperature_celsius", 1.0),
    ("power", "power_usage_watts", 1.0),
)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # a field the GPU does not report ("not available")


class SystemMetricsSink:
    """Callable that logs each monitor sample into an MLflow run.

    A sample is any object with ``gpus`` (readings with some of ``index``,
    ``utilization`` in %, ``memory_used``/``memory_total`` in bytes,
    ``temperature`` in deg C, ``power`` in W), and optionally ``host`` and
    ``time`` (seconds since the epoch), like :class:`nbtools.monitor.Sample`.
    Fields a GPU does not report are skipped, never raised.

    Args:
        logger: The run to log into; nothing is logged on a disabled (non-zero) rank.
        prefix: Name prefix, MLflow's ``system/`` by default.
        local_host: Host whose GPUs are logged without a ``node_<host>/`` part;
            default this machine's name.
    """

    def __init__(
        self, logger: MlflowLogger, prefix: str = "system/", local_host: str | None = None
    ) -> None:
        if not isinstance(logger, MlflowLogger):
            raise TypeError(f"logger must be an MlflowLogger, got {type(logger).__name__}")
        self._logger = logger
        self._prefix = prefix
        self._local = local_host or socket.gethostname() or "localhost"
        self._steps: dict[str, int] = {}

    def __call__(self, sample: Any) -> None:
        """Log one sample; the GPUs of one poll share a step (one step sequence per host)."""
        host = getattr(sample, "host", None) or self._local
        step = self._steps.get(host, 0)
        self._steps[host] = step + 1
        stamp = _number(getattr(sample, "time", None))
        timestamp = int((stamp if stamp is not None else time.time()) * 1000)
        base = self._prefix if host == self._local else f"{self._prefix}node_{host}/"
        enqueue = self._logger._enqueue
        for reading in getattr(sample, "gpus", ()) or ():
            name = f"{base}gpu_{getattr(reading, 'index', 0)}_"
            for attribute, suffix, scale in _FIELDS:
                value = _number(getattr(reading, attribute, None))
                if value is not None:
                    enqueue(name + suffix, value * scale, step, timestamp)
            used = _number(getattr(reading, "memory_used", None))
            total = _number(getattr(reading, "memory_total", None))
            if used is not None and total:
                enqueue(name + "memory_usage_percentage", 100.0 * used / total, step, timestamp)
