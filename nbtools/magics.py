"""IPython magics: ``%load_ext nbtools`` registers ``%gpu_pane`` and ``%%autoresume``.

Importing this module imports IPython but nothing heavy: torch, the checkpoint
package and the pane are imported when a magic first runs.

Example (in a notebook)::

    %load_ext nbtools
    %gpu_pane --simulated 2

    %%autoresume /mnt/vol/run1/checkpoints --every 100 --state model,optimizer,loader
    for step in range(start_step, 10_000):
        train_step()
        checkpoint(step)
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbtools._magics import (
    AutoresumeOptions,
    DistributedMagics,
    run_autoresume,
    strip_comment,
)

__all__ = ["NbtoolsMagics", "load", "unload"]

_LINE_MAGICS = ("gpu_pane",)
_CELL_MAGICS = ("autoresume",)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive integer"
_positive_float.__name__ = "positive number"


@magics_class
class NbtoolsMagics(Magics):
    """The nbtools magics; one instance per shell, holding the pane it opened."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.pane: Any = None
        self._pane_logger: Any = None

    def close_pane(self) -> None:
        """Close the pane opened by ``%gpu_pane`` (stops its polling)."""
        pane, self.pane = self.pane, None
        logger, self._pane_logger = self._pane_logger, None
        if pane is not None:
            pane.close()
        if logger is not None:
            logger.close()  # flushes the last samples; an adopted run stays open

    @magic_arguments()
    @argument(
        "--interval",
        type=_positive_float,
        default=None,
        metavar="S",
        help="seconds between samples (default: the pane's)",
    )
    @argument(
        "--simulated",
        type=_positive_int,
        default=None,
        metavar="N",
        help="show N simulated GPUs instead of the real ones (demos, no GPU)",
    )
    @argument(
        "--cluster",
        choices=["ray"],
        default=None,
        help="every node of the connected Ray cluster (with --simulated: N simulated "
        "GPUs on every node)",
    )
    @argument(
        "--mlflow",
        action="store_true",
        help="also log every sample as MLflow system metrics (to the active or resumed "
        "run, else a new one), and the run's events as an artifact when the pane closes",
    )
    @argument("--close", action="store_true", help="close the pane and stop polling")
    @line_magic
    def gpu_pane(self, line: str) -> Any:
        """Open (and show) the GPU resources pane: utilization, memory, temperature per GPU.

        Returns the :class:`~nbtools.monitor.GPUPane` (``pane = %gpu_pane``). A second
        ``%gpu_pane`` replaces the pane the first one opened.
        """
        args = parse_argstring(self.gpu_pane, strip_comment(line))
        self.close_pane()
        if args.close:
            return None
        from nbtools.monitor import GPUPane

        kwargs: dict[str, Any] = {}
        if args.interval is not None:
            kwargs["interval"] = args.interval
        try:
            kwargs["backend"] = _pane_backend(args.cluster, args.simulated)
            self.pane = GPUPane(**kwargs)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"gpu_pane: {exc}") from None
        if args.mlflow:
            self._log_pane_to_mlflow()
        return self.pane

    def _log_pane_to_mlflow(self) -> None:
        from nbtools.tracking import MlflowLogger, SystemMetricsSink, current_run_id

        logger = MlflowLogger(run_id=current_run_id(), events_to_mlflow=True)
        host = getattr(self.pane.sampler.backend, "host", None)
        self._pane_logger = logger
        self.pane.sampler.add_sink(SystemMetricsSink(logger, local_host=host))

    @magic_arguments()
    @argument("root", metavar="ROOT", help="checkpoint directory (or fsspec URL)")
    @argument(
        "--every",
        type=_positive_int,
        default=None,
        metavar="N",
        help="save every N steps (default: the CheckpointManager's)",
    )
    @argument(
        "--keep",
        type=_positive_int,
        default=None,
        metavar="K",
        help="keep the K newest checkpoints (default: all)",
    )
    @argument(
        "--memory-every",
        type=_positive_int,
        default=None,
        dest="memory_every",
        metavar="N",
        help="also snapshot into node memory every N steps (default: off)",
    )
    @argument(
        "--replicas",
        type=int,
        default=None,
        metavar="K",
        help="peer ranks that also hold each rank's memory snapshot "
        "(default: 1 across nodes, else 0)",
    )
    @argument(
        "--state",
        default=None,
        metavar="NAMES",
        help="comma-separated objects to save and restore (default: every object "
        "of the notebook with state_dict() and load_state_dict())",
    )
    @argument(
        "--mlflow",
        action="store_true",
        help="log to an MLflow run, resumed from the checkpoint, as mlflow_logger",
    )
    @argument("--run-name", default=None, metavar="NAME", help="name of the MLflow run")
    @cell_magic
    def autoresume(self, line: str, cell: str) -> Any:
        """Run the cell as a resumable training loop.

        Before the body: the latest valid checkpoint under ROOT is restored into
        the named objects and ``start_step`` is set (0 when fresh). In the body:
        ``checkpoint(step)`` saves in the background when due. After the body,
        however it ends: the save in flight is completed and the last saved step
        printed; running the cell again continues from there.
        """
        __tracebackhide__ = True  # IPython shows the user's cell, not this frame
        args = parse_argstring(self.autoresume, strip_comment(line))
        options = AutoresumeOptions(
            root=args.root.strip("'\""),
            every=args.every,
            keep=args.keep,
            state=args.state,
            mlflow=args.mlflow,
            run_name=args.run_name,
            memory_every=args.memory_every,
            replicas=args.replicas,
        )
        return run_autoresume(self.shell, options, cell)


def load(ipython: Any) -> None:
    """Register the magics with ``ipython`` (``%load_ext nbtools``)."""
    ipython.register_magics(NbtoolsMagics)
    ipython.register_magics(DistributedMagics)


def unload(ipython: Any) -> None:
    """Remove the magics and close the pane they opened (``%unload_ext nbtools``)."""
    manager = ipython.magics_manager
    instance = manager.registry.pop(NbtoolsMagics.__name__, None)
    if instance is not None:
        instance.close_pane()
    ranks = manager.registry.pop(DistributedMagics.__name__, None)
    if ranks is not None and ranks.pool is not None:
        ranks.pool.close()  # the ranks a %distributed start began end with the extension
    for name in (*_LINE_MAGICS, "distributed"):
        manager.magics["line"].pop(name, None)
    for name in (*_CELL_MAGICS, "distributed"):
        manager.magics["cell"].pop(name, None)


def _pane_backend(cluster: str | None, simulated: int | None) -> Any:
    """The backend ``%gpu_pane`` asks for: a Ray cluster, simulated GPUs, or None (NVML here)."""
    if cluster is not None:
        from nbtools.monitor.cluster import cluster_backend

        return cluster_backend(cluster, simulated=simulated)
    if simulated is not None:
        from nbtools.monitor import SimulatedBackend

        return SimulatedBackend(num_gpus=simulated)
    return None
