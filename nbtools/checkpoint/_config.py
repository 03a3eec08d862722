"""``CheckpointConfig``: every setting of a :class:`~nbtools.checkpoint.CheckpointManager`,
frozen and checked once, where it is made.

The manager takes one (``config=``) or builds one from its keyword arguments; the
saver, the volume tier and the memory tier read their settings from it. Settings
the environment gives (``NBTOOLS_STAGING_DIR``, ``NBTOOLS_SNAPSHOT_DIR``) are read
where they are used, through ``nbtools._internal.settings``.

Example:
    >>> config = CheckpointConfig(every=100, keep=3, memory_every=10)
    >>> config.snapshots
    True
    >>> CheckpointConfig(keep=0)
    Traceback (most recent call last):
    ...
    ValueError: keep must be at least 1 (or None), got 0
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from nbtools.checkpoint._checks import non_negative, positive

__all__ = ["CheckpointConfig"]


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How a :class:`~nbtools.checkpoint.CheckpointManager` saves, keeps and restores.

    Each setting means what the manager's argument of the same name means.

    Volume saves and reads: ``every``, ``keep``, ``async_save``, ``staging_dir``
    (where shards are staged on their way to and from the root), ``sync_files``,
    ``save_on_close`` and ``takeover``. The memory tier: ``memory_every`` (None:
    no snapshots) and ``replicas`` (None: 1 when the job spans several nodes, else 0).

    Raises (on construction):
        TypeError: a setting of the wrong type.
        ValueError: a setting out of range.
    """

    every: int | None = None
    keep: int | None = None
    async_save: bool = True
    staging_dir: str | os.PathLike[str] | None = None
    sync_files: bool = True
    save_on_close: bool = True
    takeover: bool = False
    memory_every: int | None = None
    replicas: int | None = None

    def __post_init__(self) -> None:
        positive("every", self.every)
        positive("keep", self.keep)
        positive("memory_every", self.memory_every)
        non_negative("replicas", self.replicas)
        for name in ("async_save", "sync_files", "save_on_close", "takeover"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
        if self.staging_dir is not None:
            if not isinstance(self.staging_dir, (str, os.PathLike)):
                raise TypeError(
                    "staging_dir must be a path (str or os.PathLike) or None, not "
                    f"{type(self.staging_dir).__name__}"
                )
            object.__setattr__(self, "staging_dir", os.fspath(self.staging_dir) or None)

    @property
    def snapshots(self) -> bool:
        """Whether the memory tier takes snapshots (``memory_every`` is set)."""
        return self.memory_every is not None

    @classmethod
    def of(cls, config: CheckpointConfig | None, **settings: Any) -> CheckpointConfig:
        """``config``, or the config of ``settings`` (the manager's keyword arguments).

        Raises:
            TypeError: ``config`` is not a CheckpointConfig, or it comes with settings
                that differ from their defaults (say each setting once, in one place).
        """
        if config is None:
            return cls(**settings)
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, not {type(config).__name__}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        given = sorted(k for k, v in settings.items() if v != defaults[k])
        if given:
            raise TypeError(
                f"pass the settings either in config= or as keyword arguments, not both: "
                f"move {', '.join(given)} into the CheckpointConfig "
                "(dataclasses.replace(config, ...) makes one with them changed)"
            )
        return config
