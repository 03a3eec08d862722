"""Timing settings: one set of defaults, checked input, and a history that stays bounded."""

from __future__ import annotations

import inspect
import logging
import math

import pytest

from nbtools.monitor import (
    DEFAULT_HISTORY_SECONDS,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_INTERVAL,
    MAX_HISTORY_POINTS,
    History,
    Sampler,
    SimulatedBackend,
    acquire,
)

_BAD_INTERVALS = [
    (math.inf, ValueError, "interval must be a finite number"),
    (math.nan, ValueError, "interval must be a finite number"),
    (0, ValueError, "interval must be at least 0.01 s"),
    (-5, ValueError, "interval must be at least 0.01 s"),
    (1e-9, ValueError, "interval must be at least 0.01 s"),
    ("10", TypeError, "interval must be a number of seconds, got str"),
    (True, TypeError, "interval must be a number of seconds, got bool"),
]


@pytest.mark.parametrize(("interval", "error", "match"), _BAD_INTERVALS)
def test_a_bad_interval_is_refused_by_the_sampler_and_by_acquire(interval, error, match):
    with pytest.raises(error, match=match):
        Sampler(SimulatedBackend(1), interval=interval, start=False)
    with pytest.raises(error, match=match):
        acquire(SimulatedBackend(1), interval=interval, start=False)


@pytest.mark.parametrize(
    ("history", "error", "match"),
    [
        (math.inf, ValueError, "history must be a finite number"),
        (math.nan, ValueError, "history must be a finite number"),
        (None, TypeError, "history must be a number of seconds"),
    ],
)
def test_a_bad_history_is_refused(history, error, match):
    with pytest.raises(error, match=match):
        Sampler(SimulatedBackend(1), history_seconds=history, start=False)


@pytest.mark.parametrize("idle", [math.nan, math.inf, 0, -1])
def test_a_bad_idle_timeout_is_refused(idle):
    with pytest.raises(ValueError, match="idle_timeout must be"):
        Sampler(SimulatedBackend(1), idle_timeout=idle, start=False)


def test_a_short_interval_against_a_long_history_keeps_a_bounded_ring(clock, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")
    month = 30 * 24 * 3600.0
    sampler = Sampler(
        SimulatedBackend(8), interval=0.01, history_seconds=month, clock=clock, start=False
    )
    try:
        assert sampler.samples.capacity == MAX_HISTORY_POINTS
        assert "keeping the newest 20000" in caplog.text and "Use a longer interval" in caplog.text
        for _ in range(3):
            sampler.refresh()
            clock.advance(0.01)
        # 8 GPUs x 9 fields x 8 bytes per point, plus the times: about 11 MiB at the bound.
        assert sampler.samples.nbytes <= MAX_HISTORY_POINTS * 8 * (8 * 9 + 1)
    finally:
        sampler.close()


def test_the_history_itself_refuses_an_unbounded_capacity():
    with pytest.raises(ValueError, match="between 1 and 20000"):
        History(10**9)
    with pytest.raises(TypeError, match="integer number of samples"):
        History(True)


def test_defaults_are_defined_once_and_acquire_has_typed_parameters():
    from nbtools.monitor.pane import GPUPane

    expected = {"interval": DEFAULT_INTERVAL, "idle_timeout": DEFAULT_IDLE_TIMEOUT}
    pane = inspect.signature(GPUPane).parameters
    assert {name: pane[name].default for name in expected} == expected
    assert pane["history"].default == DEFAULT_HISTORY_SECONDS
    for function in (Sampler, acquire):
        params = inspect.signature(function).parameters
        assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())
        assert {name: params[name].default for name in expected} == expected
        assert params["history_seconds"].default == DEFAULT_HISTORY_SECONDS
    assert (DEFAULT_INTERVAL, DEFAULT_HISTORY_SECONDS, DEFAULT_IDLE_TIMEOUT) == (10, 7200, 300)


def test_seconds_of_history_and_the_samples_have_different_names(clock):
    sampler = Sampler(
        SimulatedBackend(1), interval=10, history_seconds=60, clock=clock, start=False
    )
    try:
        assert sampler.history_seconds == 60.0
        assert isinstance(sampler.samples, History) and sampler.samples.capacity == 7
    finally:
        sampler.close()
