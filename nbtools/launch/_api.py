"""The ``@distributed`` decorator: run a notebook function on N ranks."""

from __future__ import annotations

import functools
import math
import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from nbtools.errors import DistributedError, LaunchError
from nbtools.launch import _env, _inrank, _payload, _runner, _sources
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
    ) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.gpus = gpus
        self.processes = processes
        self.max_restarts = max_restarts
        self.output = output
        self.hang_timeout = hang_timeout

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        """Run the function here, in this process, like the undecorated function."""
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        where = f"gpus={self.gpus}" if self.gpus else f"processes={self.processes}"
        if self.gpus is None and self.processes is None:
            where = "all GPUs"
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
        plan = self._plan()
        payload = _payload.pack(self._fn, args, kwargs)
        blobs = _runner.run(payload, plan, _sources.localizer(self._fn))
        results = []
        for rank, blob in enumerate(blobs):
            try:
                results.append(pickle.loads(blob))
            except Exception as exc:  # noqa: BLE001 - any unpickling error means the same
                raise DistributedError(
                    f"the return value of rank {rank} cannot be loaded here: "
                    f"{type(exc).__name__}: {exc}. Return plain data instead."
                ) from exc
        return results

    def _plan(self) -> _runner.Plan:
        if self.processes is not None:
            return _runner.Plan(
                self.processes, False, self.max_restarts, self.output, self.hang_timeout
            )
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
) -> Callable[[Callable[..., R]], DistributedFunction[R]]: ...


def distributed(
    fn: Callable[..., R] | None = None,
    *,
    gpus: int | None = None,
    processes: int | None = None,
    max_restarts: int = 0,
    output: str = "all",
    hang_timeout: float | None = None,
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

    Neither ``gpus`` nor ``processes``: every visible GPU.

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

    def decorate(target: Callable[..., R]) -> DistributedFunction[R]:
        if isinstance(target, DistributedFunction):
            target = target._fn
        if not callable(target):
            raise TypeError(
                f"@distributed decorates a function, got {type(target).__name__} {target!r:.60}"
            )
        if multiprocessing.parent_process() is None:
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


def _check_count(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
