"""The elastic bounds of @distributed: min_gpus, min_processes, min_nodes and replace_within."""

from __future__ import annotations

import pytest

from nbtools.launch import distributed
from nbtools.launch._config import LaunchConfig


def square(x):
    """Square a number."""
    return x * x


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (
            {"processes": 4, "min_processes": 5},
            ValueError,
            "min_processes=5 is more than processes=4",
        ),
        ({"gpus": 8, "min_gpus": 9}, ValueError, "min_gpus=9 is more than gpus=8"),
        ({"processes": 4, "min_processes": 0}, ValueError, "min_processes must be at least 1"),
        ({"processes": 4, "min_processes": 2.5}, TypeError, "min_processes must be an integer"),
        ({"processes": 4, "min_gpus": 3}, ValueError, "use min_processes=3"),
        ({"gpus": 4, "min_processes": 3}, ValueError, r"processes=4, min_processes=3"),
        (
            {"processes": 4, "cluster": "ray", "min_nodes": 2},
            ValueError,
            r"min_nodes=2 bounds nodes=, which is not given.*nodes=3, min_nodes=2",
        ),
        (
            {"processes": 4, "cluster": "ray", "nodes": 2, "min_nodes": 3},
            ValueError,
            "min_nodes=3 is more than nodes=2",
        ),
        (
            {"gpus": 8, "min_gpus": 6, "cluster": "ray", "nodes": 2, "min_nodes": 1},
            ValueError,
            "pass one minimum, not min_gpus and min_nodes",
        ),
        ({"processes": 4, "replace_within": -1}, ValueError, "replace_within must be a finite"),
        ({"processes": 4, "replace_within": float("nan")}, ValueError, "replace_within"),
        ({"processes": 4, "replace_within": "60"}, TypeError, "replace_within must be a number"),
    ],
)
def test_bad_bounds_are_refused_before_anything_starts(kwargs, error, words):
    with pytest.raises(error, match=words):
        distributed(**kwargs)


def test_bounds_are_kept_and_say_how_few_ranks_the_run_may_go_on_with():
    fn = distributed(processes=4, min_processes=3)(square)
    assert (fn.min_processes, fn.replace_within) == (3, 60.0)
    assert fn.config.elastic and fn.config.min_world_size(4) == 3
    assert "min_processes=3" in repr(fn)
    assert fn(3) == 9  # a plain call is untouched
    ray = LaunchConfig(gpus=8, cluster="ray", nodes=4, min_nodes=3, replace_within=5)
    assert ray.min_world_size(8) == 6 and ray.replace_within == 5
    assert LaunchConfig(min_gpus=2).min_world_size(8) == 2  # every visible GPU, at least 2
    assert LaunchConfig(gpus=8, min_gpus=6).pool_key != LaunchConfig(gpus=8).pool_key


def test_without_a_minimum_the_run_keeps_its_size():
    config = distributed(processes=4)(square).config
    assert not config.elastic and config.min_world_size(4) == 4
    assert config.min_gpus is config.min_processes is config.min_nodes is None
