"""What a metric must be before it is queued: MLflow's rules, checked on the caller's side.

A value MLflow would refuse is refused when it is logged, with the reason,
instead of failing a whole batch in the background later.
"""

from __future__ import annotations

from typing import Any

from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    bad_character_message,
    path_not_unique,
    validate_param_and_metric_name,
)

from nbtools._internal.log import get_logger

__all__ = ["MAX_STEPS_PER_METRIC", "StepLimit", "check_metric_name", "prepare_value"]

_log = get_logger("tracking")

#: MLflow's documented limit on the number of values of one metric in one run.
MAX_STEPS_PER_METRIC = 10_000_000
# Warn once a metric has this share of the limit, so there is time to react.
_WARN_SHARE = 0.9


def check_metric_name(key: object) -> None:
    """Apply MLflow's rules for metric names (``mlflow.utils.validation``) before a value is queued.

    Raises:
        TypeError: ``key`` is not a string.
        ValueError: MLflow would refuse the name.
    """
    if not isinstance(key, str):
        raise TypeError(f"a metric name must be a string, got {type(key).__name__} {key!r}")
    if not key or not validate_param_and_metric_name(key):
        raise ValueError(f"invalid metric name {key!r}: {bad_character_message()}")
    if path_not_unique(key):
        raise ValueError(
            f"invalid metric name {key!r}: it must be a relative path without '.', '..', "
            "a leading '/' or '//' (e.g. 'train/loss')"
        )
    if len(key) > MAX_ENTITY_KEY_LENGTH:
        raise ValueError(
            f"invalid metric name {key[:40]!r}...: {len(key)} characters, MLflow allows "
            f"{MAX_ENTITY_KEY_LENGTH}"
        )


def prepare_value(key: str, value: Any) -> Any:
    """A float, or a one-element tensor converted later by the writer (no device sync here).

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: ``value`` is a tensor of more than one element.
    """
    if isinstance(value, int):
        return float(value)
    detach = getattr(value, "detach", None)
    if detach is not None:
        tensor = detach()
        if tensor.numel() != 1:
            raise ValueError(
                f"metric {key!r} must be one number, got a tensor of shape "
                f"{tuple(tensor.shape)}; log a reduction such as .mean()"
            )
        return tensor.clone()  # the caller may change its tensor in place afterwards
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from None


class StepLimit:
    """Warns, once per metric, before a metric passes MLflow's limit of values per run.

    Args:
        log_every: The logger keeps one value in ``log_every`` steps.
        total_steps: Planned steps; warns at once when they would pass the limit.
    """

    def __init__(self, log_every: int, total_steps: int | None = None) -> None:
        self.log_every = log_every
        #: The step from which :meth:`passing` is called.
        self.warn_at = int(MAX_STEPS_PER_METRIC * _WARN_SHARE) * log_every
        self._warned: set[str] = set()
        if total_steps is not None and total_steps // log_every > MAX_STEPS_PER_METRIC:
            _log.warning(
                "with total_steps=%d and log_every=%d each metric would get %d values, more "
                "than MLflow's limit of %d per metric; use log_every=%d or more",
                total_steps,
                log_every,
                total_steps // log_every,
                MAX_STEPS_PER_METRIC,
                -(-total_steps // MAX_STEPS_PER_METRIC),
            )

    def passing(self, key: str, step: int) -> None:
        """Warn that ``key`` nears the limit at ``step`` (once per metric)."""
        if key in self._warned:
            return
        self._warned.add(key)
        _log.warning(
            "metric %r has about %d values at step %d; MLflow allows %d per metric. "
            "Log it less often (log_every, now %d) before the run passes the limit",
            key,
            step // self.log_every,
            step,
            MAX_STEPS_PER_METRIC,
            self.log_every,
        )
