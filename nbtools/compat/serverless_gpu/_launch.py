"""``serverless_gpu.distributed``: the managed runtime's decorator, as nbtools' ``@distributed``."""

from __future__ import annotations

from typing import Any

from nbtools._internal.log import get_logger
from nbtools.launch import distributed as _nbtools_distributed

__all__ = ["distributed"]

_log = get_logger("compat")


def _gpu_type_name(gpu_type: Any) -> str | None:
    """The name of a ``gpu_type`` given as a string or an enum member (``GPUType.H100``)."""
    if gpu_type is None:
        return None
    name = getattr(gpu_type, "value", gpu_type)
    if not isinstance(name, str) or not name.strip():
        raise TypeError(
            f"gpu_type must be a GPU type name such as 'A10' or 'H100', got "
            f"{type(gpu_type).__name__} {gpu_type!r:.40}"
        )
    return name


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def distributed(
    gpus: int | None = None,
    gpu_type: Any = None,
    remote: bool = False,
    run_async: bool = False,
    **options: Any,
) -> Any:
    """The documented ``@distributed(gpus=8, gpu_type='H100', remote=True)``, on this machine.

    Returns nbtools' decorator: ``fn.distributed(...)`` runs ``fn`` on the ranks
    and returns one result per rank, ``fn(...)`` runs it here.

    Args:
        gpus: Number of ranks, one per GPU. On a machine without GPUs nbtools runs
            this many CPU ranks (gloo) instead, and says so.
        gpu_type: Taken; nbtools uses this machine's GPUs whatever their type (one
            warning line says so).
        remote: ``True`` asks the managed service for remote GPUs; nbtools has no such
            pool and runs the ranks on this machine (one warning line says so).
        run_async: ``True`` asks for a handle to wait on; nbtools' ``.distributed()``
            runs the call to its end and returns the results (one warning line).
        **options: nbtools' own options of ``nbtools.distributed`` (``processes=``,
            ``max_restarts=``, ``output=``, ``cluster=``, ...).

    Raises:
        TypeError: An argument has the wrong type (an unknown option included).
        ValueError: ``gpus`` is below 1, or this machine has some GPUs but fewer.
    """
    for name, value in (("remote", remote), ("run_async", run_async)):
        if not isinstance(value, bool):
            raise TypeError(
                f"{name} must be True or False, got {type(value).__name__} {value!r:.40}"
            )
    type_name = _gpu_type_name(gpu_type)
    if gpus is None and "processes" not in options:
        raise TypeError(
            "distributed() needs gpus=N (the number of ranks), as on the managed runtime; "
            "or nbtools' processes=N for N CPU ranks"
        )
    notes = []
    if remote:
        notes.append(
            "remote=True: nbtools has no remote GPU pool; the ranks run on this machine "
            "(cluster='ray' spreads them over a Ray cluster)"
        )
    if type_name is not None:
        notes.append(
            f"gpu_type={type_name!r}: nbtools does not choose GPU types; the ranks use this "
            "machine's GPUs, whatever their type"
        )
    if run_async:
        notes.append(
            "run_async=True: nbtools' .distributed() runs the call to its end and returns one "
            "result per rank; there is no handle to wait on"
        )
    if gpus is not None:
        if "processes" in options:
            raise ValueError("pass either gpus= or nbtools' processes=, not both")
        if (
            not isinstance(gpus, bool)
            and isinstance(gpus, int)
            and gpus >= 1
            and not _visible_gpus()
        ):
            notes.append(
                f"gpus={gpus}: torch sees no GPU here; nbtools runs {gpus} CPU ranks (gloo) "
                "instead, tensors stay on the CPU"
            )
            options["processes"] = gpus
        else:
            options["gpus"] = gpus
    decorator = _nbtools_distributed(**options)  # checks gpus and every option
    for note in notes:
        _log.warning("%s", note)
    return decorator
