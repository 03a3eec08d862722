"""How a rank's own process is made to behave like a plain notebook before user code runs.

Ranks are forked from the launcher's forkserver, so they inherit a process
that differs from a notebook kernel in ways that user code notices:

- ``multiprocessing``'s default start method is ``forkserver`` (the rank was
  started that way), so loader workers would receive their dataset by pickle,
  and classes defined in notebook cells or inside the launched function cannot
  be pickled by reference. :func:`restore_start_method` gives the rank the
  start method a plain Linux notebook has, ``fork``.
- The default process group already exists, so a user's own
  ``init_process_group`` must be a no-op (:func:`guard_user_group_calls`).

These functions run in the rank only, never in the caller.
"""

from __future__ import annotations

import functools
import multiprocessing

from nbtools._internal import hooks
from nbtools._internal.log import get_logger

__all__ = [
    "restore_start_method",
    "guard_user_group_calls",
    "mark_in_rank",
    "in_rank",
    "private_temp_dir",
]

_log = get_logger("launch")
_IN_RANK = False


def mark_in_rank() -> None:
    """Record that this process is a rank started by ``@distributed``."""
    global _IN_RANK
    _IN_RANK = True
    hooks.rank_started()  # integrations from above, e.g. MLflow's rank-zero-only runs


def in_rank() -> bool:
    """True inside a rank started by ``@distributed`` (and its forked children)."""
    return _IN_RANK


def private_temp_dir() -> None:
    """Give this rank its own ``multiprocessing`` temporary directory.

    A forkserver child inherits the caller's ``pymp-*`` directory, which holds
    the caller's forkserver socket; whatever the rank's code starts with
    ``multiprocessing`` (managers, a forkserver of its own) must not create or
    remove files there.
    """
    config = getattr(multiprocessing.current_process(), "_config", None)
    if isinstance(config, dict):
        config.pop("tempdir", None)


def restore_start_method() -> None:
    """Make ``multiprocessing``'s default start method in this rank what a notebook has: fork.

    The forkserver sets the child's start method to ``forkserver`` for good
    (``set_start_method(..., force=True)``), which makes every process the
    rank's code starts (DataLoader workers above all, also those built by HF
    Trainer, accelerate or Lightning) pickle its target: a dataset class from a
    notebook cell then fails with "Can't pickle <class '__main__.X'>".

    The rank's choice is reset rather than forced, so a user's own
    ``multiprocessing.set_start_method("spawn")`` (or torch's hint
    ``set_start_method("fork")``) still works as in a notebook. Where the
    interpreter's own default is not ``fork`` (Python 3.14 and later), ``fork``
    is chosen explicitly, because that is what notebook users of torch's loader
    workers rely on.

    Why forking here is CUDA-safe enough: the rank itself never forks its
    parent's CUDA state (it was started from the forkserver); what forks now are
    the rank's own children. Forked loader workers that never touch CUDA are
    the configuration torch users run every day on GPU ranks under torchrun;
    a worker that does need CUDA must ask for ``spawn`` explicitly, as it would
    in any torchrun script.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return  # not Linux/Unix: keep what the platform does
    multiprocessing.set_start_method(None, force=True)
    if _platform_default() != "fork":
        multiprocessing.set_start_method("fork", force=True)


def _platform_default() -> str:
    # The default context's own choice, read without fixing it (get_start_method would).
    ctx = multiprocessing.context._default_context  # type: ignore[attr-defined]
    default = getattr(ctx, "_default_context", None)
    return getattr(default, "_name", "fork")


def guard_user_group_calls(active_backend: str) -> None:
    """Let the user's own ``init_process_group`` be a no-op once the group is up.

    A call asking for a backend the running group does not have (``nccl`` in
    CPU ranks) logs a warning once, naming the active backend; the call itself
    stays harmless so that unchanged torchrun-style code keeps working.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.init_process_group
    if getattr(original, "_nbtools_guard", False):
        return
    warned = []

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if not c10d.is_initialized():
            return original(*args, **kwargs)
        requested = kwargs.get("backend", args[0] if args else None)
        if requested and not warned and not _covered(str(requested), active_backend):
            warned.append(True)
            kind = "GPU" if "nccl" in active_backend else "CPU"
            _log.warning(
                "init_process_group(backend=%r) was not needed and was skipped: @distributed "
                "already set up the default process group with backend %r for these %s ranks. "
                "%s",
                requested,
                active_backend,
                kind,
                "Use @distributed(gpus=N) for NCCL on GPUs."
                if kind == "CPU"
                else "Remove the call or pass the backend above.",
            )
        return None

    init_process_group._nbtools_guard = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _covered(requested: str, active: str) -> bool:
    """Whether every backend in ``requested`` ("nccl", "cuda:nccl,cpu:gloo") is active."""

    def names(spec: str) -> set[str]:
        return {part.split(":")[-1].strip().lower() for part in spec.split(",") if part.strip()}

    return names(requested) <= names(active)
