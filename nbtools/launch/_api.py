"""The ``@distributed`` decorator: run a notebook function on N ranks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from nbtools._internal import hooks
from nbtools.errors import LaunchError
from nbtools.launch import _env, _payload, _runner, _sources
from nbtools.launch._config import LaunchConfig
from nbtools.launch._rank import in_rank

__all__ = ["distributed", "DistributedFunction", "warm_up"]

R = TypeVar("R")


class DistributedFunction(Generic[R]):
    """A function that runs in-process when called and on N ranks via :meth:`distributed`.

    Created by :func:`distributed`; see there for the options, which
    :attr:`config` holds (also readable as attributes: ``fn.processes``, ...).
    """

    def __init__(self, fn: Callable[..., R], config: LaunchConfig) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.config = config

    def __getattr__(self, name: str) -> Any:
        # The options as attributes (``fn.gpus``, ``fn.hang_timeout``), read from the config.
        if name in LaunchConfig.__dataclass_fields__:
            return getattr(self.__dict__["config"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        """Run the function here, in this process, like the undecorated function."""
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<distributed function {self.__qualname__} ({self.config.describe()})>"

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
        __tracebackhide__ = True
        if in_rank():
            # A rank's ranks would share its forkserver state and multiply the world;
            # the caller's launcher stays untouched because nothing starts here.
            raise LaunchError(
                f"{self.__qualname__}.distributed() was called inside a rank of another "
                "@distributed call; launches do not nest. This code already runs on every "
                f"rank: call {self.__qualname__}(...) directly instead."
            )
        if self.config.keep_alive:
            from nbtools.launch.pool import call_kept

            return call_kept(self._fn, self.config, args, kwargs)
        backend = self.config.backend()
        plan = self.config.plan(backend)
        backend.check(plan.world_size, plan.use_cuda)
        payload = _payload.pack(self._fn, args, kwargs)
        hooks.before_launch(payload)  # integrations from above (e.g. a new MLflow store)
        blobs = _runner.run(payload, plan, _sources.localizer(self._fn), backend)
        return _payload.unpack_values(enumerate(blobs), "the return value of rank")


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
    on_hang: str = "report",
    rich_output: str = "rank0",
    min_gpus: int | None = None,
    min_processes: int | None = None,
    min_nodes: int | None = None,
    replace_within: float = 60.0,
    heal: bool = False,
    results_device: str = "cpu",
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
    on_hang: str = "report",
    rich_output: str = "rank0",
    min_gpus: int | None = None,
    min_processes: int | None = None,
    min_nodes: int | None = None,
    replace_within: float = 60.0,
    heal: bool = False,
    results_device: str = "cpu",
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
            This is about text (prints, logging, warnings); rich output is
            ``rich_output``'s.
        rich_output: where ``display()``, ``IPython.display`` objects, pandas
            tables and matplotlib figures (``plt.show()``) from the ranks go:
            ``"rank0"`` (default) shows rank 0's in the cell as the kernel
            would (HTML, PNG, Markdown) and drops the other ranks'; ``"all"``
            shows every rank's, each labelled ``[rank N]``; ``"none"``: ranks
            print the text form, as a script would. Outside a kernel (a
            script, a terminal) the text form is printed too.
        hang_timeout: seconds without progress after which a rank that others
            wait for is a hang: one warning names it, with every rank's Python
            stack. ``None`` (default): ten median step times, at least 45 s.
            Ranks report progress by themselves through ``CheckpointManager``
            and nbtools' ``DataLoader``, or by ``events.step(step)``; a run that
            reports none falls back to this many seconds without output (off
            when ``None``). An interrupt always prints the stacks.
        on_hang: ``"report"`` (default) warns and keeps waiting; ``"restart"``
            restarts the group (counted against ``max_restarts``).
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
        min_gpus: the fewest GPUs (``min_processes``: CPU ranks; ``min_nodes``:
            Ray nodes) the run may go on with when some are lost for good; at
            most ``gpus`` (``processes``, ``nodes``). Validated when the call is
            made. Without a minimum nothing changes. Size batches with
            ``nbtools.runtime.batch_plan`` or ``DataLoader(global_batch_size=)``
            so the global batch survives a change of world size.
        min_processes: CPU ranks on this machine heal in place (as with
            ``heal=True``), and a slot whose replacement fails to start twice is
            lost for good: the survivors keep their processes and go on as a
            group of the remaining size, numbered densely, from the state they
            hold (``restore()`` takes it: no volume read), the global batch kept;
            one line in the cell and a ``shrunk`` event say so. A lost slot is
            tried again (after 1 s, doubling up to 30 s); once it starts, the group grows back at
            its next ``maybe_save`` (a ``grew`` event). Each shrink and each
            grow counts as one restart. Fewer slots than the minimum fail the
            call, naming them. ``min_gpus`` and ``min_nodes`` are checked, and
            such runs still restart at their full size.
        min_nodes: see ``min_gpus``; with ``cluster="ray"`` and ``nodes=``.
        replace_within: with ``min_nodes``: seconds a lost Ray node may take to
            be replaced before the run counts it as gone (default 60).

        heal: with ``max_restarts`` (CPU ranks, this machine): a rank that dies
            (SIGKILL, the OOM killer, ``os._exit``) is replaced while the others
            keep their processes. Their pending collectives fail, the function
            unwinds through its context managers, and runs again in the same
            processes (the same function object) in a group re-formed with a
            fresh replacement; each heal counts as one restart, and
            ``get_restart_count()`` gives the new attempt in every rank. A
            ``CheckpointManager``'s ``restore()`` then takes the state the
            survivors hold (the replacement gets it from a survivor), so no step
            is trained again; where it cannot, it restores from its snapshots,
            saying why. One line in the cell says what happened. A rank that
            raised fails the call as without healing; ranks on GPUs restart.
        results_device: where CUDA tensors in the ranks' return values arrive:
            ``"cpu"`` (default: copied to host memory in the rank, so the kernel
            never creates a CUDA context or holds GPU memory for them) or
            ``"cuda"`` (kept on the GPU, which needs CUDA in the caller).

    Neither ``gpus`` nor ``processes``: every visible GPU (of the cluster, with ``cluster=``).

    Example:
        >>> @distributed(processes=2)  # doctest: +SKIP
        ... def world(x):
        ...     import torch.distributed as dist
        ...     return dist.get_world_size() * x
        >>> world.distributed(3)  # doctest: +SKIP
        [6, 6]

        Called as a plain function (``world(3)``), it runs here, in this process, with
        no group.
    """
    config = LaunchConfig(
        gpus=gpus,
        processes=processes,
        max_restarts=max_restarts,
        output=output,
        hang_timeout=hang_timeout,
        cluster=cluster,
        nodes=nodes,
        runtime_env=runtime_env,
        keep_alive=keep_alive,
        on_hang=on_hang,
        rich_output=rich_output,
        min_gpus=min_gpus,
        min_processes=min_processes,
        min_nodes=min_nodes,
        replace_within=replace_within,
        heal=heal,
        results_device=results_device,
    )

    def decorate(target: Callable[..., R]) -> DistributedFunction[R]:
        if isinstance(target, DistributedFunction):
            target = target._fn
        if not callable(target):
            raise TypeError(
                f"@distributed decorates a function, got {type(target).__name__} {target!r:.60}"
            )
        if cluster is None:
            # Start the forkserver now, so that torch is loaded in it by the first call.
            # Not in a child (a rank, or a spawn/forkserver child importing the module
            # that defines this function): starting processes there is unsafe.
            warm_up()
        return DistributedFunction(target, config)

    if fn is None:
        return decorate
    if not callable(fn):
        raise TypeError(
            f"distributed() takes the function to decorate or keyword options "
            f"(gpus=, processes=), got {type(fn).__name__} {fn!r:.60}; "
            f"did you mean distributed(processes={fn!r:.10})?"
        )
    return decorate(fn)


def warm_up() -> None:
    """Start what local launches need, in the background, and return at once.

    The forkserver that ranks start from imports torch and what training code
    uses (optimizers, DCP, nbtools' checkpoint and data packages) once; a call
    that finds it ready starts its ranks in a fraction of a second. Applying
    ``@distributed``, creating a ``RankPool`` and ``%load_ext nbtools`` call
    this; a call that comes before the imports are done does not wait for
    them (its ranks import what they use themselves). Does nothing inside a
    rank or a child process.
    """
    if _env.may_start_processes():
        _env.warm_up()


def _shutdown() -> None:
    """Stop every pool this process holds: those of ``keep_alive=True`` and every ``RankPool``.

    Also runs when the kernel exits. Leaves no rank process behind.
    """
    from nbtools.launch.pool import shutdown

    shutdown()


distributed.shutdown = _shutdown  # type: ignore[attr-defined]
