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

import multiprocessing

from nbtools import _torch_compat
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

    See :func:`nbtools._torch_compat.restore_fork_start_method` (it reads a
    private name of ``multiprocessing``, so it lives in the boundary module).
    """
    _torch_compat.restore_fork_start_method()


def guard_user_group_calls(active_backend: str) -> None:
    """Let the user's own ``init_process_group`` be a no-op once the group is up.

    A call asking for a backend the running group does not have (``nccl`` in
    CPU ranks) logs a warning once, naming the active backend; the call itself
    stays harmless so that unchanged torchrun-style code keeps working. The
    shim replaces torch attributes, so it lives in the boundary module
    (:func:`nbtools._torch_compat.guard_init_process_group`).
    """
    _torch_compat.guard_init_process_group(active_backend, _skipped)


def _skipped(requested: str, active_backend: str) -> None:
    kind = "GPU" if "nccl" in active_backend else "CPU"
    _log.warning(
        "init_process_group(backend=%r) was not needed and was skipped: @distributed "
        "already set up the default process group with backend %r for these %s ranks. %s",
        requested,
        active_backend,
        kind,
        "Use @distributed(gpus=N) for NCCL on GPUs."
        if kind == "CPU"
        else "Remove the call or pass the backend above.",
    )
