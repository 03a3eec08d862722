"""CheckpointConfig: the manager's settings, frozen and checked once, given whole or by keyword."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from ckpt_training import Net

from nbtools.checkpoint import CheckpointConfig, CheckpointManager


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"keep": 0}, ValueError, "keep must be at least 1"),
        ({"every": 2.5}, TypeError, "every must be an int"),
        ({"memory_every": 0}, ValueError, "memory_every must be at least 1"),
        ({"replicas": -1}, ValueError, "replicas must be at least 0"),
        ({"async_save": "yes"}, TypeError, "async_save must be a bool"),
        ({"takeover": 1}, TypeError, "takeover must be a bool"),
        ({"staging_dir": 3}, TypeError, "staging_dir must be a path"),
    ],
)
def test_a_bad_setting_is_refused_where_the_config_is_made(settings, error, match):
    with pytest.raises(error, match=match):
        CheckpointConfig(**settings)


def test_the_config_is_frozen_and_takes_keywords_only(tmp_path):
    config = CheckpointConfig(every=4, staging_dir=pathlib.Path(tmp_path))
    assert config.staging_dir == str(tmp_path)
    assert not config.snapshots
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.every = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        CheckpointConfig(4)  # type: ignore[misc]


def test_a_manager_made_from_a_config_saves_as_the_keywords_say(tmp_path):
    config = CheckpointConfig(every=2, keep=1, async_save=False)
    with CheckpointManager(tmp_path / "c", config=config) as ckpt:
        assert ckpt.config is config
        assert (ckpt.every, ckpt.keep, ckpt.async_save) == (2, 1, False)
        model = Net()
        for step in range(1, 5):
            ckpt.maybe_save(step, model=model)
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_4"]
    with CheckpointManager(tmp_path / "c", every=2, keep=1, async_save=False) as ckpt:
        assert ckpt.config == config
        assert ckpt.restore(model=Net()) == 5


def test_a_config_and_keywords_that_differ_together_are_refused(tmp_path):
    with pytest.raises(TypeError, match="move every, keep into the CheckpointConfig"):
        CheckpointManager(tmp_path / "c", every=3, keep=2, config=CheckpointConfig(every=2))
    with pytest.raises(TypeError, match="config must be a CheckpointConfig"):
        CheckpointManager(tmp_path / "c", config={"every": 2})  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()
