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
- Functions and classes from notebook cells arrive by value, so ``__main__``
  does not hold them and pickling them by reference (``multiprocessing``,
  ``torch.save``) fails. :func:`adopt_main` makes the function's notebook
  globals the rank's ``__main__``, as ipyparallel does for its engines, and
  :func:`pickle_main_by_value` lets ``multiprocessing`` send such names to
  ``spawn`` and ``forkserver`` children by value, since those children have no
  notebook to import them from (under ``torchrun`` they re-import the script).
- On a gloo-only default group (CPU ranks), DCP's ``async_save`` runs its
  collectives from a background thread on the same group as the training
  loop's (DDP's all-reduce): the two interleave and hang.
  :func:`separate_async_saves` gives those saves a gloo group of their own, as
  ``gpus=N`` ranks have with ``cpu:gloo,cuda:nccl``.

:func:`enter_rank` runs them all, in order, with the rest of what every rank
does before the user's function (threads, device, logging, displays, trainer
hooks): the elastic worker (:mod:`._worker`, which pool ranks start through)
and the Ray actor call it alike.

These functions run in the rank only, never in the caller.
"""

from __future__ import annotations

import builtins
import multiprocessing
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from nbtools._internal import hooks
from nbtools._internal.log import get_logger
from nbtools.launch._rank import _display, _kernel_logging, _rank_exit, _trainer_hooks

__all__ = [
    "RESULTS_DEVICES",
    "RESULTS_DEVICE_ENV",
    "enter_rank",
    "setup_environment",
    "restore_start_method",
    "guard_user_group_calls",
    "mark_in_rank",
    "in_rank",
    "private_temp_dir",
    "adopt_main",
    "bind_to",
    "pickle_main_by_value",
    "separate_async_saves",
    "forget_async_save_group",
]

#: Where CUDA tensors in a rank's return value arrive: ``"cpu"`` (copied to host memory in
#: the rank, so the caller never creates a CUDA context for them) or ``"cuda"``.
RESULTS_DEVICES = ("cpu", "cuda")
#: Carries the call's ``results_device`` to the rank, where ``launch._results`` reads it.
RESULTS_DEVICE_ENV = "NBTOOLS_RESULTS_DEVICE"

_log = get_logger("launch")
_IN_RANK = False


def enter_rank(
    payload: bytes, *, backend: str, device: int | None, exit_handlers: bool = True
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Make this process a rank, then unpickle the user's call: ``(fn, args, kwargs)``.

    In order: torch's thread count from ``OMP_NUM_THREADS``, the rank's GPU
    (``device``, before anything in the payload can touch one), the exit
    handlers the rank's code registers (``exit_handlers``: run at the rank's end
    by :mod:`._rank_exit`), the in-rank mark, the kernel's logging, displays,
    trainer hooks, ``fork`` as the start method, the guard on the user's own
    ``init_process_group`` (``backend`` is the group's), then the payload, whose
    function becomes ``__main__``'s, and DCP's async saves on a group of their own.
    The default process group is not formed here: each backend forms it its own way.
    """
    import cloudpickle
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if device is not None:
        torch.cuda.set_device(device)
    if exit_handlers:
        _rank_exit.watch()  # what the rank's code registers for interpreter exit runs at its end
    mark_in_rank()
    _kernel_logging.apply()
    _display.install()
    _trainer_hooks.install()  # HF and Lightning trainers report their steps
    restore_start_method()
    guard_user_group_calls(backend)
    # Unpickle after the guards are in place: a function that refers to
    # ``init_process_group`` by name resolves to the guarded version.
    fn, args, kwargs = cloudpickle.loads(payload)
    # Cell-defined names resolve by reference here as in the kernel (multiprocessing, torch.save).
    fn = adopt_main(fn)
    pickle_main_by_value()
    separate_async_saves()
    return fn, args, kwargs


def setup_environment(
    directory: str, rich_output: str, results_device: str = "cpu"
) -> dict[str, str]:
    """In the kernel: the variables that carry its logging, displays and the device of
    returned CUDA tensors to :func:`enter_rank`.

    Args:
        directory: the launch's private directory, where ranks leave their rich output.
        rich_output: whose rich output reaches the cell (``RICH_OUTPUT_MODES``).
        results_device: where CUDA tensors of a rank's return value arrive
            (``"cpu"`` or ``"cuda"``).
    """
    return {
        **_kernel_logging.environment(),
        **_display.environment(directory, rich_output),
        RESULTS_DEVICE_ENV: results_device,
    }


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
    from nbtools import _torch_compat  # torch: the rank's, not the kernel's import

    _torch_compat.restore_fork_start_method()


def guard_user_group_calls(active_backend: str) -> None:
    """Let the user's own ``init_process_group`` be a no-op once the group is up.

    A call asking for a backend the running group does not have (``nccl`` in
    CPU ranks) logs a warning once, naming the active backend; the call itself
    stays harmless so that unchanged torchrun-style code keeps working. The
    shim replaces torch attributes, so it lives in the boundary module
    (:func:`nbtools._torch_compat.guard_init_process_group`).
    """
    from nbtools import _torch_compat

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


def adopt_main(fn: Any) -> Any:
    """Make ``fn``'s notebook globals this rank's ``__main__``; return ``fn`` bound to them.

    Only for a function from ``__main__`` (a notebook cell or a script): a cell
    function it calls, a cell class it uses, then resolve as ``__main__.name``,
    as in the kernel. Any other function is returned as it is.
    """
    if not isinstance(fn, types.FunctionType) or fn.__module__ != "__main__":
        return fn
    main = types.ModuleType("__main__")
    namespace = main.__dict__
    namespace["__builtins__"] = builtins
    for name, value in fn.__globals__.items():
        if not name.startswith("__"):
            namespace[name] = value
    sys.modules["__main__"] = main
    return bind_to(fn, namespace)


def bind_to(fn: types.FunctionType, namespace: dict[str, Any]) -> types.FunctionType:
    """``fn`` with ``namespace`` as its globals (ipyparallel's ``interactive``)."""
    bound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__kwdefaults__ = fn.__kwdefaults__
    bound.__qualname__ = fn.__qualname__
    bound.__module__ = fn.__module__
    bound.__doc__ = fn.__doc__
    bound.__dict__.update(fn.__dict__)
    return bound


def pickle_main_by_value() -> None:
    """Let ``multiprocessing`` pickle ``__main__``'s functions and classes by value (cloudpickle).

    A ``spawn`` or ``forkserver`` child of a rank starts with an empty
    ``__main__``: a cell-defined dataset class sent by reference would not be
    found there. Everything else keeps ``multiprocessing``'s own pickling.
    """
    from multiprocessing.reduction import ForkingPickler

    if getattr(ForkingPickler, "reducer_override", None) is _main_by_value:
        return
    setattr(ForkingPickler, "reducer_override", _main_by_value)  # noqa: B010 - a class attribute


def _main_by_value(pickler: Any, obj: Any) -> Any:
    if (
        isinstance(obj, (type, types.FunctionType))
        and getattr(obj, "__module__", None) == "__main__"
    ):
        import cloudpickle

        return cloudpickle.loads, (cloudpickle.dumps(obj),)
    return NotImplemented


def separate_async_saves() -> None:
    """Give ``dcp.async_save`` calls without a ``process_group`` a gloo group of their own.

    Only when the default group is gloo-only: with ``cpu:gloo,cuda:nccl`` the
    training loop's collectives run on NCCL and the saves' on gloo already.
    The group is made at the first such save, which every rank calls together
    (a save is collective), so every rank makes it at the same point. DCP is
    not imported for this: the change is made when user code imports it.
    """
    hooks.after_import(_SAVER, _wrap_async_save)  # before ``dcp/__init__`` takes the name


_SAVER = "torch.distributed.checkpoint.state_dict_saver"
# The gloo group of the async saves (made at the first one; see ``separate_async_saves``).
_ASYNC_SAVE_GROUPS: list[Any] = []


def forget_async_save_group() -> None:
    """Forget the async saves' group: the group it belonged to is gone (a heal re-formed it)."""
    _ASYNC_SAVE_GROUPS.clear()


def _wrap_async_save(saver: types.ModuleType) -> None:
    original = saver.async_save
    if getattr(original, "_nbtools_separate", False):
        return
    groups = _ASYNC_SAVE_GROUPS

    def async_save(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if (
            kwargs.get("process_group") is None
            and not kwargs.get("no_dist", False)
            and dist.is_initialized()
            and "nccl" not in str(dist.get_backend())  # gloo-only: one queue for everything
        ):
            if not groups:
                groups.append(dist.new_group(backend="gloo"))
            kwargs["process_group"] = groups[0]
        return original(*args, **kwargs)

    async_save._nbtools_separate = True  # type: ignore[attr-defined]
    async_save.__doc__ = original.__doc__
    async_save.__wrapped__ = original  # type: ignore[attr-defined]
    saver.async_save = async_save  # type: ignore[attr-defined]
    package = sys.modules.get("torch.distributed.checkpoint")
    if package is not None and getattr(package, "async_save", None) is original:
        package.async_save = async_save  # type: ignore[attr-defined]
