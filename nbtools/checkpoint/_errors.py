"""Turning DCP's ``CheckpointException`` (a ``BaseException``) into nbtools errors."""

from __future__ import annotations

from typing import Any

from nbtools.errors import CheckpointError, NbtoolsError

__all__ = ["unwrap"]


def unwrap(exc: BaseException, what: str) -> BaseException:
    """The error to raise for ``exc``: the first nbtools error of any rank, else a CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures: dict[int, Any] = exc.failures
        for rank in sorted(failures):
            inner = failures[rank][0]
            if isinstance(inner, NbtoolsError):
                return inner
        rank = min(failures) if failures else -1
        inner = failures[rank][0] if failures else exc
        err = CheckpointError(f"{what} failed on rank {rank}: {type(inner).__name__}: {inner}")
        err.__cause__ = exc
        return err
    if isinstance(exc, NbtoolsError):
        return exc
    if isinstance(exc, Exception):
        err = CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err
    return exc
