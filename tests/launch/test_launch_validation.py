"""Bad input to @distributed is refused with a clear error before any process starts."""

from __future__ import annotations

import psutil
import pytest

from nbtools.launch import DistributedFunction, _env, distributed


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def square(x):
    """Square a number."""
    return x * x


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"gpus": 1, "processes": 1}, ValueError, "not both"),
        ({"processes": 0}, ValueError, "at least 1"),
        ({"gpus": -2}, ValueError, "at least 1"),
        ({"processes": "2"}, TypeError, "integer"),
        ({"processes": True}, TypeError, "integer"),
        ({"processes": 2, "max_restarts": -1}, ValueError, "max_restarts"),
        ({"processes": 2, "output": "rank1"}, ValueError, "rank0"),
        ({"processes": 2, "output": ["all"]}, TypeError, "output must be a string"),
        ({"processes": 2, "max_restarts": 1.5}, TypeError, "max_restarts"),
        ({"processes": 2, "hang_timeout": "60"}, TypeError, "hang_timeout"),
        ({"processes": 2, "hang_timeout": True}, TypeError, "hang_timeout"),
        ({"processes": 2, "hang_timeout": 0}, ValueError, "positive"),
        ({"processes": 2, "hang_timeout": -5}, ValueError, "positive"),
        ({"processes": 2, "hang_timeout": float("inf")}, ValueError, "finite"),
        ({"processes": 2, "hang_timeout": float("nan")}, ValueError, "finite"),
        (
            {"processes": 2, "rich_output": "rank1"},
            ValueError,
            "rich_output must be one of 'rank0', 'all', 'none'",
        ),
        ({"processes": 2, "rich_output": None}, ValueError, "rich_output must be one of"),
    ],
)
def test_bad_options_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        distributed(**kwargs)


def test_rich_output_is_kept_and_reaches_the_plan_and_a_pools_options():
    from nbtools.launch import RankPool

    fn = distributed(processes=2, rich_output="all")(square)
    assert fn.rich_output == "all" and distributed(processes=2)(square).rich_output == "rank0"
    from nbtools.launch._local import LocalBackend

    assert fn.config.plan(LocalBackend()).rich_output == "all"
    with pytest.raises(ValueError, match="rich_output"):
        RankPool(processes=1, rich_output="every")  # refused before any rank starts


def test_hang_timeout_is_kept():
    assert distributed(processes=2, hang_timeout=30)(square).hang_timeout == 30
    assert distributed(processes=2)(square).hang_timeout is None


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match="decorates a function"):
        distributed(processes=2)(42)
    with pytest.raises(TypeError, match="processes="):
        distributed(2)


def test_plain_call_runs_in_process_and_keeps_the_function_identity():
    wrapped = distributed(processes=2)(square)
    assert isinstance(wrapped, DistributedFunction)
    assert wrapped(7) == 49
    assert wrapped.__name__ == "square" and wrapped.__doc__ == "Square a number."
    assert distributed(square).processes is None  # bare @distributed: all GPUs


@pytest.mark.skipif(_env.visible_gpu_count() > 0, reason="checks the message without CUDA")
def test_gpus_without_cuda_suggests_processes():
    before = _children()
    with pytest.raises(ValueError, match=r"processes=2"):
        distributed(gpus=2)(square).distributed(3)
    assert _children() == before


def test_all_gpus_with_none_visible_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_env, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match=r"no GPU.*processes=N"):
        distributed()(square).distributed(3)


def test_more_gpus_than_visible_is_refused(monkeypatch):
    monkeypatch.setattr(_env, "visible_gpu_count", lambda: 2)  # stand-in for the hardware
    before = _children()
    with pytest.raises(ValueError, match="more GPUs than the 2 visible"):
        distributed(gpus=4)(square).distributed(3)
    assert _children() == before


def test_arguments_that_do_not_fit_the_signature_fail_before_start():
    before = _children()
    with pytest.raises(TypeError, match="missing a required argument|missing 1 required"):
        distributed(processes=2)(square).distributed()
    assert _children() == before
