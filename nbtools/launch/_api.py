"""The ``@distributed`` decorator: run a notebook function on N ranks."""

from __future__ import annotations

import functools
import math
import multiprocessing
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from nbtools._internal import hooks
from nbtools.errors import LaunchError
from nbtools.launch import _env, _inrank, _payload, _runner, _sources
from nbtools.launch._backend import LaunchBackend
from nbtools.launch._output import OUTPUT_MODES

__all__ = ["distributed", "DistributedFunction"]

R = TypeVar("R")


class DistributedFunction(Generic[R]):
    """A function that runs in-process when called and on N ranks via :meth:`distributed`.

    Created by :func:`distributed`; see there for the options.
    """

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        gpus: int | None,
        processes: int | None,
        max_restarts: int,
        output: str,
        hang_timeout: float | None = None,
        cluster: str | None = None,
        nodes: int | None = None,
        runtime_env: dict | None = None,
        keep_alive: bool = False,
    ) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.gpus = gpus
        self.processes = processes
        self.max_restarts = max_restarts
        self.output = output
        self.hang_timeout = hang_timeout
        self.cluster = cluster
        self.nodes = nodes
        self.runtime_env = runtime_env
        self.keep_alive = keep_alive

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        """Run the function here, in this process, like the undecorated function."""
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        where = f"gpus={self.gpus}" if self.gpus else f"processes={self.processes}"
        if self.gpus is None and self.processes is None:
            where = "all GPUs"
        if self.cluster is not None:
            where += f", cluster={self.cluster!r}"
            where += f", nodes={self.nodes}" if self.nodes is not None else ""
        return f"<distributed function {self.__qualname__} ({where})>"

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Run the function on every rank with these arguments; one result per global rank.

        Each rank has RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
        and MASTER_PORT set and the default process group initialised. Output of
        every rank streams live, prefixed ``[rank N]``.

        Raises:
            ValueError: the machine cannot provide the requested GPUs.
            TypeError: the arguments do not fit the function's signature.
            nbtools.errors.PicklingError: the function or an argument cannot be sent.
            nbtools.errors.DistributedError: a rank failed (after any restarts).
            nbtools.errors.LaunchError: called inside a rank (nested launch).
            KeyboardInterrupt: the caller was interrupted; all ranks are stopped.
        """
        if _inrank.in_rank():
            # A rank's ranks would share its forkserver state and multiply the world;
            # the caller's launcher stays untouched because nothing starts here.
            raise LaunchError(
                f"{self.__qualname__}.distributed() was called inside a rank of another "
                "@distributed call; launches do not nest. This code already runs on every "
                f"rank: call {self.__qualname__}(...) directly instead."
            )
        if self.keep_alive:
            from nbtools.launch._pool_kept import call_kept

            return call_kept(self, args, kwargs)
        backend = self._backend()
        plan = self._plan(backend)
        backend.check(plan.world_size, plan.use_cuda)
        payload = _payload.pack(self._fn, args, kwargs)
        hooks.before_launch(payload)  # integrations from above (e.g. a new MLflow store)
        blobs = _runner.run(payload, plan, _sources.localizer(self._fn), backend)
        return _payload.unpack_values(enumerate(blobs), "the return value of rank")

    def _backend(self) -> LaunchBackend:
        if self.cluster == "ray":
            from nbtools.launch._ray import RayBackend

            return RayBackend(nodes=self.nodes, runtime_env=self.runtime_env)
        from nbtools.launch._local import LocalBackend

        return LocalBackend()

    def _plan(self, backend: LaunchBackend) -> _runner.Plan:
        if self.processes is not None:
            return _runner.Plan(
                self.processes, False, self.max_restarts, self.output, self.hang_timeout
            )
        if self.cluster is not None:
            # The cluster's GPUs, not this machine's: the backend checks what it has.
            count = self.gpus if self.gpus is not None else backend.gpu_count()
            if count == 0:
                raise ValueError(
                    f"@distributed(cluster={self.cluster!r}) without gpus= or processes= runs one "
                    "rank per GPU of the cluster, but it has no GPU. Use processes=N for N CPU "
                    "ranks."
                )
            return _runner.Plan(count, True, self.max_restarts, self.output, self.hang_timeout)
        visible = _env.visible_gpu_count()
        if self.gpus is None:
            if visible == 0:
                raise ValueError(
                    "@distributed() runs one rank per visible GPU, but torch sees no GPU here. "
                    "Use @distributed(processes=N) for N CPU ranks."
                )
            return _runner.Plan(
                visible, True, self.max_restarts, self.output, self.hang_timeout
            )
        if visible == 0:
            raise ValueError(
                f"gpus={self.gpus} needs CUDA, but torch sees no GPU here. "
                f"Use processes={self.gpus} for {self.gpus} CPU ranks with gloo."
            )
        if self.gpus > visible:
            raise ValueError(
                f"gpus={self.gpus} asks for more GPUs than the {visible} visible here. "
                f"Use gpus={visible} or fewer (check CUDA_VISIBLE_DEVICES)."
            )
        return _runner.Plan(self.gpus, True, self.max_restarts, self.output, self.hang_timeout)


@overload
def distributed(fn: Callable[..., R]) -> DistributedFunction[R]: ...


@overload
def distributed(
    fn: None = None,
    *,
    gpus: int | None = None,
    processes: int | None = None,
    max_restarts: int = 0,
    output: str = "all",
    hang_timeout: float | None = None,
    cluster: str | None = None,
    nodes: int | None = None,
    runtime_env: dict | None = None,
    keep_alive: bool = False,
) -> Callable[[Callable[..., R]], DistributedFunction[R]]: ...


def distributed(
    fn: Callable[..., R] | None = None,
    *,
    gpus: int | None = None,
    processes: int | None = None,
    max_restarts: int = 0,
    output: str = "all",
    hang_timeout: float | None = None,
    cluster: str | None = None,
    nodes: int | None = None,
    runtime_env: dict | None = None,
    keep_alive: bool = False,
) -> Any:
    """Decorate a function so that ``fn.distributed(...)`` runs it on N ranks.

    Ranks are started by ``torch.distributed.elastic`` from a forkserver, which
    is safe when CUDA is already initialised in the kernel. The function and its
    arguments travel by cloudpickle, so code defined in notebook cells works.

    Args:
        fn: the function (when used as ``@distributed`` without parentheses).
        gpus: one rank per GPU on this many GPUs; group ``cpu:gloo,cuda:nccl``,
            device ``cuda:LOCAL_RANK``.
        processes: this many CPU ranks with a ``gloo`` group.
        max_restarts: restart the whole group up to this many times after a
            failure; ranks see the count in ``TORCHELASTIC_RESTART_COUNT``
            (``nbtools.runtime.get_restart_count()``).
        output: ``"all"`` streams every rank's output, ``"rank0"`` only rank 0's,
            ``"none"`` nothing. Progress bars (carriage-return updates) are
            drawn for rank 0 only; the other ranks' finished lines still print.
        hang_timeout: after this many seconds without output from any rank,
            print every rank's Python stack once (the call keeps running).
            ``None`` (default) never does. An interrupt always prints them
            before the ranks are stopped.
        cluster: ``None`` (default) runs the ranks on this machine; ``"ray"``
            runs one Ray actor per rank on the Ray cluster this process is
            connected to (``ray.init``), else the one at ``RAY_ADDRESS`` or
            ``auto``. Ranks are packed onto as few nodes as Ray can, ordered by
            node then GPU; ``NODE_RANK`` tells the node. Needs ``nbtools[ray]``.
        nodes: with ``cluster="ray"``: spread the ranks over exactly this many nodes.
        runtime_env: with ``cluster="ray"``: Ray's ``runtime_env`` for every rank
            (``{"pip": [...], "env_vars": {...}, "working_dir": ...}``).
        keep_alive: ``.distributed()`` runs on ranks kept alive between calls
            (one ``RankPool`` per configuration): a warm call costs milliseconds.
            Ranks keep their state between calls; ``distributed.shutdown()``
            (or the end of the kernel) stops them.

    Neither ``gpus`` nor ``processes``: every visible GPU (of the cluster, with ``cluster=``).

    Example:
        >>> @distributed(processes=2)
        ... def world(x):
        ...     import torch.distributed as dist
        ...     return dist.get_world_size() * x
        >>> world.distributed(3)  # doctest: +SKIP
        [6, 6]
        >>> world(3)  # doctest: +SKIP  (in-process, no group)
    """
    _check_count("gpus", gpus)
    _check_count("processes", processes)
    if gpus is not None and processes is not None:
        raise ValueError("pass either gpus= (one rank per GPU) or processes= (CPU ranks), not both")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int):
        raise TypeError(
            f"max_restarts must be an integer >= 0, got {type(max_restarts).__name__} "
            f"{max_restarts!r:.40}"
        )
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if not isinstance(output, str):
        raise TypeError(
            f"output must be a string ({', '.join(OUTPUT_MODES)}), got "
            f"{type(output).__name__} {output!r:.40}"
        )
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {', '.join(OUTPUT_MODES)}; got {output!r}")
    _check_hang_timeout(hang_timeout)
    _check_cluster(cluster, nodes, runtime_env)
    if not isinstance(keep_alive, bool):
        raise TypeError(f"keep_alive must be True or False, got {type(keep_alive).__name__}")

    def decorate(target: Callable[..., R]) -> DistributedFunction[R]:
        if isinstance(target, DistributedFunction):
            target = target._fn
        if not callable(target):
            raise TypeError(
                f"@distributed decorates a function, got {type(target).__name__} {target!r:.60}"
            )
        if cluster is None and multiprocessing.parent_process() is None:
            # Start the forkserver now, so that torch is loaded in it by the first call.
            # Not in a child (a rank importing the module that defines this function).
            _env.warm_up()
        return DistributedFunction(
            target,
            gpus=gpus,
            processes=processes,
            max_restarts=max_restarts,
            output=output,
            hang_timeout=hang_timeout,
            cluster=cluster,
            nodes=nodes,
            runtime_env=runtime_env,
            keep_alive=keep_alive,
        )

    if fn is None:
        return decorate
    if not callable(fn):
        raise TypeError(
            f"distributed() takes the function to decorate or keyword options "
            f"(gpus=, processes=), got {type(fn).__name__} {fn!r:.60}; "
            f"did you mean distributed(processes={fn!r:.10})?"
        )
    return decorate(fn)


def _shutdown() -> None:
    """Stop every pool this process holds: those of ``keep_alive=True`` and every ``RankPool``.

    Also runs when the kernel exits. Leaves no rank process behind.
    """
    from nbtools.launch._pool import shutdown

    shutdown()


distributed.shutdown = _shutdown  # type: ignore[attr-defined]


def _check_hang_timeout(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"hang_timeout must be a number of seconds or None, got {type(value).__name__} "
            f"{value!r:.40}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"hang_timeout must be a positive, finite number of seconds (or None to turn it "
            f"off), got {value!r}"
        )


def _check_cluster(cluster: Any, nodes: Any, runtime_env: Any) -> None:
    if cluster is not None and not isinstance(cluster, str):
        raise TypeError(f"cluster must be None or 'ray', got {type(cluster).__name__} {cluster!r:.40}")
    if cluster not in (None, "ray"):
        raise ValueError(
            f"cluster must be None or 'ray' (the engines nbtools can launch on), got {cluster!r}"
        )
    _check_count("nodes", nodes)
    if nodes is not None and cluster is None:
        raise ValueError(
            f"nodes= needs cluster='ray': without a cluster every rank runs on this machine. "
            f"Use @distributed(..., cluster='ray', nodes={nodes})."
        )
    if runtime_env is not None:
        if not isinstance(runtime_env, dict):
            raise TypeError(
                f"runtime_env must be a dict (Ray's runtime_env), got {type(runtime_env).__name__}"
            )
        if cluster is None:
            raise ValueError(
                "runtime_env= needs cluster='ray': ranks on this machine use this environment"
            )


def _check_count(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
