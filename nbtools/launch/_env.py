"""The machine side of a launch: GPUs, loopback, ports, rank environments, start method.

Ranks start from a forkserver: a fresh interpreter (never a fork of the caller,
so CUDA already initialised in a notebook kernel is harmless) that imports
torch once; every rank after that is a cheap fork of it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator

__all__ = [
    "START_METHOD",
    "PRELOAD",
    "LIBRARIES",
    "preloads",
    "visible_gpu_count",
    "loopback_interface",
    "free_port",
    "rank_environment",
    "warm_up",
    "may_start_processes",
    "main_module_hidden",
    "signal_handlers_kept",
    "caller_environment",
]

#: CUDA-safe and fast once warm; ``spawn`` would re-import torch in every rank.
START_METHOD = "forkserver"

#: Imported once by the forkserver so that each rank starts with them loaded: torch,
#: what every optimizer's constructor imports (``torch._dynamo``, about a second of
#: a fresh rank's time) and DCP's state-dict helpers that a restore uses first. A
#: restarted group then reaches its first step without importing them again. So do
#: nbtools' own checkpoint and data packages, which a rank's code imports before it
#: restores (about 0.15 s of CPU per rank, per restart).
#: ``nbtools.launch._local._forkserver`` comes first and also loads the installed object-store
#: clients. None starts a thread or touches a device. ``__main__`` is deliberately absent: a
#: script's top level must not run again.
PRELOAD = [
    "nbtools.launch._local._forkserver",  # first: settles the forkserver (see there)
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing",
    "torch._dynamo",
    "torch.optim",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "nbtools.launch._rank",
    "nbtools.checkpoint.manager",  # the package's door is lazy: what a restore uses
    "nbtools.data",
    "nbtools.launch._local._forkserver_ready",  # last: every preload is in (``_forkserver.ready``)
]

#: Libraries a rank takes seconds to import again after a restart (HF's Trainer, Lightning,
#: MLflow): the forkserver also preloads those that the caller has imported by the time it
#: starts it (:func:`preloads`), so a restarted rank finds them loaded. None starts a thread.
LIBRARIES = (
    "transformers",
    "transformers.trainer",
    "lightning",
    "lightning.pytorch",
    "pytorch_lightning",
    "mlflow",
)

_MAIN_LOCK = threading.RLock()

# Signals that ``PContext.start`` takes over in the main thread; the caller's
# own handlers (ipykernel's SIGINT handler above all) must survive a launch.
_PCONTEXT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def visible_gpu_count() -> int:
    """Number of CUDA devices torch can use here (0 without CUDA); does not initialise CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    try:
        import psutil

        for name, addresses in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
                return name
    except (ImportError, OSError):
        pass
    return "lo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(
    base: dict[str, str],
    *,
    rank: int,
    world_size: int,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    master_port: int,
    interface: str,
    use_cuda: bool = True,
) -> dict[str, str]:
    """The environment of one rank on a single node, as torchrun would set it.

    Socket interfaces are pinned to loopback unless the caller chose one, so
    gloo and nccl listen on 127.0.0.1 only. CPU ranks also get what
    ``accelerate launch --cpu`` sets, so that a plain ``accelerate.Accelerator()``
    joins the ranks' group instead of running undistributed (accelerate only
    treats a world without ``ACCELERATE_USE_CPU`` as distributed when it has
    GPUs).
    """
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ROLE_WORLD_SIZE=str(world_size),
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        TORCHELASTIC_USE_AGENT_STORE="False",
    )
    env.setdefault("GLOO_SOCKET_IFNAME", interface)
    env.setdefault("NCCL_SOCKET_IFNAME", interface)
    if not use_cuda:
        env.setdefault("ACCELERATE_USE_CPU", "true")
    if world_size > 1:
        # As torchrun does: N ranks each using every core would oversubscribe the CPU.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def may_start_processes() -> bool:
    """Whether this process may start the forkserver now, as a side effect of decorating.

    Not in a child of ``multiprocessing`` (a rank, a pool or loader worker), and
    above all not while a spawn or forkserver child is still bootstrapping, that
    is importing the user's script again: multiprocessing refuses to start a
    process then, and a spawn pool would replace its dying workers forever.
    """
    if multiprocessing.parent_process() is not None:
        return False
    # Set by multiprocessing while a child prepares (imports ``__mp_main__``); the
    # same flag its own ``_check_not_importing_main`` reads.
    return not getattr(multiprocessing.current_process(), "_inheriting", False)


def warm_up() -> None:
    """Start the forkserver (torch preloaded) if it is not running yet; returns at once."""
    multiprocessing.set_forkserver_preload(preloads())
    with main_module_hidden():
        multiprocessing.forkserver.ensure_running()


def preloads() -> list[str]:
    """What a forkserver started now preloads: :data:`PRELOAD`, with the :data:`LIBRARIES`
    this process has imported before its last entry (which says that all are in)."""
    found = [name for name in LIBRARIES if name in sys.modules]
    return [*PRELOAD[:-1], *found, PRELOAD[-1]]


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Hide ``__main__``'s file and spec so that ranks do not import the caller's script.

    Without this, multiprocessing runs an unguarded script's top level again in
    every rank. The function travels by value (cloudpickle), so ranks never
    need the main module.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    # One launch at a time hides and restores, or a concurrent one would save the hidden state.
    with _MAIN_LOCK:
        saved = {name: vars(main)[name] for name in ("__file__", "__spec__") if name in vars(main)}
        try:
            if "__file__" in saved:
                del main.__file__
            if "__spec__" in saved:
                main.__spec__ = None
            yield
        finally:
            for name, value in saved.items():
                setattr(main, name, value)


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Restore the handlers of the signals that torch's ``PContext.start`` replaces."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for name in _PCONTEXT_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None:
            saved[signum] = signal.getsignal(signum)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def caller_environment() -> dict[str, str]:
    """A snapshot of this process's environment, which every rank inherits."""
    return dict(os.environ)
