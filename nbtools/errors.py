"""Exceptions raised by nbtools.

Every domain error derives from :class:`NbtoolsError` and from the built-in
exception that matches it, so ``except RuntimeError`` or ``except OSError``
keeps working. Validation of arguments raises plain ``ValueError``/``TypeError``.
"""

from __future__ import annotations

__all__ = [
    "NbtoolsError",
    "DistributedError",
    "LaunchError",
    "PoolError",
    "PicklingError",
    "ResultWriteError",
    "MissingDependencyError",
    "UnsupportedTorchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "StagingSpaceError",
    "CheckpointStallError",
    "DataError",
    "CacheError",
    "MonitorError",
    "TrackingError",
    "TrackingStoreError",
]


class NbtoolsError(Exception):
    """Base class of every error nbtools raises on purpose."""


# --- launching ---------------------------------------------------------------


class DistributedError(NbtoolsError, RuntimeError):
    """One or more ranks of a ``@distributed`` run failed.

    Attributes:
        failures: ``{global_rank: RankFailure-like object}`` for each failed rank;
            each has ``exc_type``, ``message`` and ``traceback`` (strings).
    """

    def __init__(self, message: str, failures: dict | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the caller's own frames and the ranks' story, not the launcher's.

        The complete traceback and chain stay on the exception (``__traceback__``,
        ``__cause__``), as Python's own traceback module prints them.
        """
        from nbtools._internal.tracebacks import user_traceback

        return user_traceback(self)


class LaunchError(NbtoolsError, RuntimeError):
    """Ranks could not be started (bad environment, rendezvous failure)."""


class PoolError(NbtoolsError, RuntimeError):
    """A ``RankPool`` cannot take the call: closed, busy, or stopped after its last restart."""


class PicklingError(NbtoolsError, TypeError):
    """The function or one of its arguments cannot be sent to the ranks."""


class ResultWriteError(NbtoolsError, OSError):
    """A rank's return value could not be written where the caller reads it (a full ``TMPDIR``)."""


class MissingDependencyError(NbtoolsError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class UnsupportedTorchError(NbtoolsError, RuntimeError):
    """The installed torch lacks something nbtools needs; the message names its version."""


# --- checkpointing -----------------------------------------------------------


class CheckpointError(NbtoolsError, RuntimeError):
    """A checkpoint could not be saved or restored."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No valid checkpoint exists where one was required."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint exists but its metadata or data cannot be read or verified."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """Checkpoint metadata asked to load a type outside the allowed set."""


class StagingSpaceError(CheckpointError, OSError):
    """Not enough free space on the local staging filesystem."""


class CheckpointStallError(CheckpointError, TimeoutError):
    """A checkpoint read made no progress for ``read_timeout`` seconds."""


# --- data --------------------------------------------------------------------


class DataError(NbtoolsError, RuntimeError):
    """A dataset or loader is used inconsistently (e.g. ranks disagree)."""


class CacheError(DataError, OSError):
    """The local file cache cannot hold or produce a file."""


# --- monitor and tracking ----------------------------------------------------


class MonitorError(NbtoolsError, RuntimeError):
    """The GPU monitor was used wrongly (never raised for a missing GPU)."""


class TrackingError(NbtoolsError, RuntimeError):
    """Experiment tracking could not log or resume a run."""

    #: True when retrying cannot help (see :class:`TrackingStoreError`).
    permanent = False


class TrackingStoreError(TrackingError):
    """The tracking store cannot be opened or written at all (e.g. a read-only database).

    Retrying does not help, so nbtools reports it at once instead of retrying;
    :attr:`permanent` is True. Other :class:`TrackingError` s (a server that does
    not answer, a busy database) may pass and are retried.
    """

    permanent = True
