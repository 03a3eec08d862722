"""The monitor's timing defaults and limits, defined once, and their validation.

``GPUPane``, :class:`~nbtools.monitor.Sampler`, :func:`~nbtools.monitor.acquire`
and ``%gpu_pane`` all take their defaults from here. The ring buffer of a
sampler holds ``ceil(history_seconds / interval) + 1`` samples per host, never
more than :data:`MAX_HISTORY_POINTS`: a longer history at a short interval
keeps the newest points and says so, instead of allocating without bound.
"""

from __future__ import annotations

import math
import numbers

from nbtools._internal.log import get_logger

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_HISTORY_SECONDS",
    "DEFAULT_IDLE_TIMEOUT",
    "MIN_INTERVAL",
    "MAX_HISTORY_POINTS",
    "history_points",
]

_log = get_logger("monitor")

#: Seconds between polls.
DEFAULT_INTERVAL = 10.0
#: Seconds of history kept (2 hours).
DEFAULT_HISTORY_SECONDS = 7200.0
#: Seconds without activity before polling pauses (5 minutes).
DEFAULT_IDLE_TIMEOUT = 300.0
#: Shortest interval accepted: a shorter one only spins a thread (NVML reads take milliseconds).
MIN_INTERVAL = 0.01
#: Most samples kept per host; 8 GPUs at this bound hold about 11 MiB.
MAX_HISTORY_POINTS = 20_000


def _seconds(name: str, value: object) -> float:
    """``value`` as a finite float; TypeError for a non-number, ValueError for NaN or infinity."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    return seconds


def history_points(interval: object, history_seconds: object, idle_timeout: object) -> int:
    """Check the timing of a sampler; return how many samples per host its history keeps.

    Args:
        interval: Seconds between polls, at least :data:`MIN_INTERVAL`.
        history_seconds: Seconds of history, at least ``interval``.
        idle_timeout: Positive seconds, or None to never pause.

    Returns:
        ``ceil(history_seconds / interval) + 1``, at most :data:`MAX_HISTORY_POINTS`
        (a warning says when the bound shortens the history).

    Raises:
        TypeError: A value is not a number (or None for ``idle_timeout``).
        ValueError: A value is NaN, infinite, or out of range.
    """
    every = _seconds("interval", interval)
    if every < MIN_INTERVAL:
        raise ValueError(
            f"interval must be at least {MIN_INTERVAL:g} s, got {interval!r}; "
            f"the default is {DEFAULT_INTERVAL:g} s"
        )
    keep = _seconds("history", history_seconds)
    if keep < every:
        raise ValueError(
            f"history must be at least interval ({every:g} s), got {history_seconds!r}"
        )
    if idle_timeout is not None and _seconds("idle_timeout", idle_timeout) <= 0:
        raise ValueError(
            f"idle_timeout must be a positive number of seconds, or None to never pause; "
            f"got {idle_timeout!r}"
        )
    points = math.ceil(keep / every) + 1
    if points > MAX_HISTORY_POINTS:
        kept = (MAX_HISTORY_POINTS - 1) * every
        _log.warning(
            "a history of %g s at one sample every %g s needs %d points; keeping the newest "
            "%d (%g s). Use a longer interval for a longer history",
            keep,
            every,
            points,
            MAX_HISTORY_POINTS,
            kept,
        )
        points = MAX_HISTORY_POINTS
    return points
