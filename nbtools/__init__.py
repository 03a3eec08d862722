"""nbtools: resilient multi-GPU PyTorch training from a notebook.

The top level stays tiny and lazy: ``import nbtools`` inside a worker rank or a
plain script imports neither torch nor any front-end library until a public
name is first used.

Example:
    >>> from nbtools import distributed
    >>> @distributed(processes=2)
    ... def hello():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> hello.distributed()  # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbtools._internal import hooks as _hooks
from nbtools.errors import DistributedError, NbtoolsError

__version__ = "0.1.0"
__all__ = ["DistributedError", "NbtoolsError", "distributed", "events", "__version__"]

# The top wires the integrations into the launcher, by name: nothing is imported here.
# MLflow: the kernel creates a new local store before ranks start; ranks other than 0
# record no runs (see nbtools.tracking._launch).
_hooks.register(
    "mlflow",
    before_launch="nbtools.tracking._launch:before_launch",
    in_rank="nbtools.tracking._launch:in_rank",
)

# The GPU pane pairs a rank with its GPU by UUID: each rank that started CUDA says which
# device it uses (see nbtools.monitor.timeline).
_hooks.register("torch", in_rank="nbtools.monitor.timeline:announce_rank_gpu")

# The checkpoint memory tier's snapshots of a launch end with it: each launch that ends
# for good (returned, failed past max_restarts, interrupted) drops them on this node.
_hooks.at_launch_end("nbtools.checkpoint._memory:end_run")

if TYPE_CHECKING:  # pragma: no cover
    from nbtools import events
    from nbtools.launch import distributed


def __getattr__(name: str) -> Any:
    if name == "distributed":
        from nbtools.launch import distributed

        return distributed
    if name == "events":
        # Plain stdlib, but kept lazy like the rest: a worker that never emits pays nothing.
        import importlib

        return importlib.import_module("nbtools.events")
    raise AttributeError(f"module 'nbtools' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """Entry point of ``%load_ext nbtools``: registers the magics and warms up launches.

    Registers ``%gpu_pane``, ``%%autoresume`` and ``%distributed``/``%%distributed``,
    then starts the forkserver that ranks start from, in the background
    (:func:`nbtools.launch.warm_up`), so the first ``@distributed`` call of the
    notebook finds torch already imported there.
    """
    from nbtools.launch import warm_up
    from nbtools.magics import load

    load(ipython)
    warm_up()


def unload_ipython_extension(ipython: Any) -> None:
    """Entry point of ``%unload_ext nbtools``."""
    from nbtools.magics import unload

    unload(ipython)
