"""Checks of the machine itself: torch and its backends, GPUs, shared memory, limits, forkserver,
and the ``NBTOOLS_*`` variables of the environment."""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import resource
import shutil
from collections.abc import Mapping
from typing import Any

from nbtools._doctor._report import Finding, Status
from nbtools._internal import settings

__all__ = [
    "SHM_FLOOR_BYTES",
    "NOFILE_FLOOR",
    "check_forkserver",
    "check_gpus",
    "check_nofile",
    "check_settings",
    "check_shm",
    "check_torch",
    "shm_location",
]

#: Below this, loader workers (batches travel through shared memory) and the in-memory
#: checkpoint tier run out of room: Docker's default of 64 MiB is the usual cause.
SHM_FLOOR_BYTES = 1 << 30
#: Loader workers, staged shards and a rank's pipes hold many descriptors at once.
NOFILE_FLOOR = 4096
_FORKSERVER_TIMEOUT_S = 60.0


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_torch() -> Finding:
    """torch, its CUDA build, NCCL and gloo as this process sees them."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return Finding(
            "torch",
            Status.FAIL,
            f"torch cannot be imported: {exc}",
            "install torch>=2.9 (pip install torch) in this environment",
        )
    details: dict[str, Any] = {
        "torch": importlib.metadata.version("torch"),
        "cuda_build": torch.version.cuda,
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "nccl_version": None,
    }
    if details["nccl"]:
        try:
            details["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            pass
    parts = [f"torch {details['torch']}", f"CUDA {details['cuda_build'] or 'none (CPU build)'}"]
    parts.append(f"NCCL {details['nccl_version'] or 'n/a'}")
    parts.append(f"gloo {'yes' if details['gloo'] else 'no'}")
    if not details["gloo"]:
        return Finding(
            "torch",
            Status.FAIL,
            ", ".join(parts) + ": no gloo backend",
            "install a torch build with torch.distributed (the PyPI wheels have it)",
            details,
        )
    return Finding("torch", Status.OK, ", ".join(parts), "", details)


def check_gpus() -> Finding:
    """The GPUs NVML reports (as the GPU pane reads them) and the ones torch counts."""
    from nbtools.monitor.backends import NVMLBackend

    details: dict[str, Any] = {"nvml": False, "gpus": [], "torch_device_count": 0}
    try:
        import torch

        # Counting devices does not initialise CUDA in this process.
        details["torch_device_count"] = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install is reported, not raised
        pass
    backend = NVMLBackend()
    try:
        if backend.available():
            details["nvml"] = True
            readings = backend.read(0.0)
            details["gpus"] = [
                {"index": r.index, "name": r.name, "memory_total": getattr(r, "memory_total", None)}
                for r in readings
            ]
    finally:
        backend.close()
    count = len(details["gpus"])
    if not details["nvml"]:
        return Finding(
            "gpus",
            Status.WARN,
            f"no GPU: {backend.message or 'NVML unavailable'}",
            "CPU ranks still work (@distributed(processes=N)); for GPUs install the NVIDIA "
            "driver and run on a GPU machine",
            details,
        )
    names = sorted({str(g["name"]) for g in details["gpus"]})
    summary = f"{count} GPU{'s' * (count != 1)} via NVML ({', '.join(names)}); torch sees {details['torch_device_count']}"
    if details["torch_device_count"] != count:
        return Finding(
            "gpus",
            Status.WARN,
            summary,
            "torch and NVML disagree: check CUDA_VISIBLE_DEVICES and that torch is a "
            "CUDA build matching the driver",
            details,
        )
    return Finding("gpus", Status.OK, summary, "", details)


def shm_location() -> str:
    """The shared-memory filesystem of the memory tier: ``NBTOOLS_SNAPSHOT_DIR`` or /dev/shm."""
    return str(settings.read("NBTOOLS_SNAPSHOT_DIR") or "/dev/shm")


def check_shm(path: str | None = None) -> Finding:
    """Size and free space of the shared-memory filesystem against what training needs.

    Args:
        path: The filesystem to measure (default :func:`shm_location`).
    """
    path = path or shm_location()
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return Finding(
            "shm",
            Status.WARN,
            f"{path} cannot be read: {exc.strerror or exc}",
            "loader workers with num_workers > 0 need a shared-memory filesystem; "
            "mount a tmpfs at /dev/shm",
            {"path": path},
        )
    details = {"path": path, "total": usage.total, "free": usage.free, "floor": SHM_FLOOR_BYTES}
    summary = f"{path}: {_gib(usage.free)} free of {_gib(usage.total)}"
    if usage.free < SHM_FLOOR_BYTES:
        return Finding(
            "shm",
            Status.WARN,
            summary + f", below the {_gib(SHM_FLOOR_BYTES)} loader workers "
            "and in-memory checkpoints need",
            "give the container more shared memory (docker run --shm-size=16g or --ipc=host; "
            "Kubernetes: an emptyDir with medium: Memory at /dev/shm), or use num_workers=0; "
            "NBTOOLS_SNAPSHOT_DIR puts in-memory checkpoints on another tmpfs",
            details,
        )
    return Finding("shm", Status.OK, summary, "", details)


def check_settings(environ: Mapping[str, str] | None = None) -> Finding:
    """The ``NBTOOLS_*`` variables of ``environ`` (default ``os.environ``) against nbtools' table.

    A value nbtools refuses fails (the code that reads it raises); a name nbtools does not
    read is a warning (a misspelt or retired name changes nothing).
    """
    environ = os.environ if environ is None else environ
    wrong = settings.problems(environ)
    names = sorted(n for n in environ if n.startswith("NBTOOLS_"))
    details: dict[str, Any] = {"set": names, "problems": wrong}
    if not wrong:
        summary = (
            f"NBTOOLS_* variables: {', '.join(names)}" if names else "no NBTOOLS_* variable set"
        )
        return Finding("settings", Status.OK, summary, "", details)
    known = {setting.name for setting in settings.SETTINGS}
    return Finding(
        "settings",
        Status.FAIL if set(wrong) & known else Status.WARN,
        "; ".join(wrong.values()),
        "fix or unset these variables; the configuration reference lists every one nbtools reads",
        details,
    )


def check_nofile() -> Finding:
    """The open-file limits of this process (ranks and their loader workers inherit them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    details = {"soft": soft, "hard": hard, "floor": NOFILE_FLOOR}

    def text(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else str(n)

    summary = f"open files: soft {text(soft)}, hard {text(hard)}"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_FLOOR:
        raise_to = (
            text(hard)
            if hard == resource.RLIM_INFINITY or hard >= NOFILE_FLOOR
            else str(NOFILE_FLOOR)
        )
        return Finding(
            "open files",
            Status.WARN,
            summary + f", below {NOFILE_FLOOR}",
            f"raise it before starting Jupyter: ulimit -n {raise_to} (or LimitNOFILE= "
            "in the service, nofile in /etc/security/limits.conf)",
            details,
        )
    return Finding("open files", Status.OK, summary, "", details)


def _child() -> None:
    """The forkserver's child: nothing to do but start and exit."""


def check_forkserver() -> Finding:
    """Start one process through multiprocessing's forkserver, as the launcher does."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return Finding(
            "forkserver",
            Status.FAIL,
            "this platform has no forkserver start method",
            "run on Linux: ranks start through a forkserver",
        )
    ctx = multiprocessing.get_context("forkserver")
    proc = ctx.Process(target=_child, name="nbtools-doctor-forkserver")
    try:
        proc.start()
        proc.join(_FORKSERVER_TIMEOUT_S)
    except OSError as exc:
        return Finding(
            "forkserver",
            Status.FAIL,
            f"a forkserver process did not start: {exc}",
            "check that the temp dir (TMPDIR) is writable and its path is short "
            "(a Unix socket path has at most 107 bytes)",
            {"error": str(exc)},
        )
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        return Finding(
            "forkserver",
            Status.FAIL,
            f"a forkserver process did not finish within {_FORKSERVER_TIMEOUT_S:.0f} s",
            "the machine may be out of memory or processes (ulimit -u)",
        )
    if proc.exitcode != 0:
        return Finding(
            "forkserver",
            Status.FAIL,
            f"a forkserver process exited with status {proc.exitcode}",
            "run python -c 'import torch' to see whether importing torch fails",
            {"exitcode": proc.exitcode},
        )
    return Finding("forkserver", Status.OK, "a process starts and exits through the forkserver")
