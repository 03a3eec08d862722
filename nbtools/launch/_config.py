"""One launch configuration: validated once, frozen, handed down from the call to the ranks.

``@distributed(...)`` and ``RankPool(...)`` both build a :class:`LaunchConfig`;
everything below them (the backend, the plan, the kept pool of a
configuration) reads it and never re-checks or re-copies its options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nbtools.launch import _env
from nbtools.launch._backend import LaunchBackend
from nbtools.launch._output import OUTPUT_MODES
from nbtools.launch._rank import RESULTS_DEVICES, RICH_OUTPUT_MODES
from nbtools.launch._runner import Plan

__all__ = ["LaunchConfig", "check_restarts"]


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Where and how ranks run; see :func:`nbtools.distributed` for each option.

    Raises (on construction):
        TypeError: an option of the wrong type.
        ValueError: an option out of range, or options that do not go together.
    """

    gpus: int | None = None
    processes: int | None = None
    max_restarts: int = 0
    output: str = "all"
    hang_timeout: float | None = None
    cluster: str | None = None
    nodes: int | None = None
    runtime_env: dict | None = None
    keep_alive: bool = False
    on_hang: str = "report"
    rich_output: str = "rank0"
    min_gpus: int | None = None
    min_processes: int | None = None
    min_nodes: int | None = None
    replace_within: float = 60.0
    heal: bool = False
    results_device: str = "cpu"

    def __post_init__(self) -> None:
        _check_count("gpus", self.gpus)
        _check_count("processes", self.processes)
        if self.gpus is not None and self.processes is not None:
            raise ValueError(
                "pass either gpus= (one rank per GPU) or processes= (CPU ranks), not both"
            )
        check_restarts(self.max_restarts)
        if not isinstance(self.output, str):
            raise TypeError(
                f"output must be a string ({', '.join(OUTPUT_MODES)}), got "
                f"{type(self.output).__name__} {self.output!r:.40}"
            )
        if self.output not in OUTPUT_MODES:
            raise ValueError(
                f"output must be one of {', '.join(OUTPUT_MODES)}; got {self.output!r}"
            )
        _check_rich_output(self.rich_output)
        _check_hang_timeout(self.hang_timeout)
        _check_on_hang(self.on_hang)
        _check_cluster(self.cluster, self.nodes, self.runtime_env)
        _check_bounds(self)
        if not isinstance(self.heal, bool):
            raise TypeError(f"heal must be True or False, got {type(self.heal).__name__}")
        if self.heal and (self.keep_alive or self.cluster is not None):
            raise ValueError(
                "heal=True heals the local ranks of a @distributed call; a kept pool "
                "(keep_alive=True) heals its CPU ranks in place by itself, and cluster='ray' "
                "restarts every rank: drop heal=True there"
            )
        if self.results_device not in RESULTS_DEVICES:
            raise ValueError(
                f"results_device must be one of {', '.join(map(repr, RESULTS_DEVICES))} (where "
                f"CUDA tensors a rank returns arrive), got {self.results_device!r:.40}"
            )
        if not isinstance(self.keep_alive, bool):
            raise TypeError(
                f"keep_alive must be True or False, got {type(self.keep_alive).__name__}"
            )

    @property
    def pool_key(self) -> tuple:
        """What makes two configurations share one kept pool (restarts and keep_alive aside)."""
        return (
            self.gpus,
            self.processes,
            self.cluster,
            self.nodes,
            repr(self.runtime_env),
            self.output,
            self.hang_timeout,
            self.rich_output,
            self.on_hang,
            self.min_gpus,
            self.min_processes,
            self.min_nodes,
            self.replace_within,
            self.results_device,
        )

    @property
    def elastic(self) -> bool:
        """Whether the run may go on with fewer ranks than it asked for (a minimum was given)."""
        return (self.min_gpus, self.min_processes, self.min_nodes) != (None, None, None)

    def min_world_size(self, world_size: int) -> int:
        """The fewest ranks a run of ``world_size`` ranks may go on with: ``world_size`` itself
        without a minimum; ``min_gpus`` or ``min_processes``; with ``min_nodes``, that many
        nodes' worth of ranks (``world_size / nodes`` per node, rounded up)."""
        if self.min_gpus is not None:
            return min(self.min_gpus, world_size)
        if self.min_processes is not None:
            return min(self.min_processes, world_size)
        if self.min_nodes is not None and self.nodes:
            per_node = -(-world_size // self.nodes)
            return min(self.min_nodes * per_node, world_size)
        return world_size

    def describe(self) -> str:
        """``processes=2``, ``gpus=8, cluster='ray'``: where the ranks run, for reprs."""
        where = f"gpus={self.gpus}" if self.gpus else f"processes={self.processes}"
        if self.gpus is None and self.processes is None:
            where = "all GPUs"
        if self.cluster is not None:
            where += f", cluster={self.cluster!r}"
            where += f", nodes={self.nodes}" if self.nodes is not None else ""
        for name in ("min_gpus", "min_processes", "min_nodes"):
            if getattr(self, name) is not None:
                where += f", {name}={getattr(self, name)}"
        return where

    def backend(self) -> LaunchBackend:
        """A new backend for this configuration: torch elastic here, or Ray actors."""
        if self.cluster == "ray":
            from nbtools.launch._ray import RayBackend

            return RayBackend(nodes=self.nodes, runtime_env=self.runtime_env)
        from nbtools.launch._local import LocalBackend

        return LocalBackend()

    def plan(self, backend: LaunchBackend) -> Plan:
        """How many ranks on which device, checked against what ``backend`` can offer.

        Raises:
            ValueError: GPUs asked for that the machine (or cluster) does not have.
        """
        world = self._world_size(backend)
        use_cuda = self.processes is None
        # CPU ranks on this machine that may go on with fewer heal in place: the survivors
        # of a lost slot form the smaller group (nbtools.launch._local._heal).
        shrinks = self.min_processes is not None and self.cluster is None and not self.keep_alive
        return Plan(
            world,
            use_cuda,
            self.max_restarts,
            self.output,
            self.hang_timeout,
            self.on_hang,
            self.rich_output,
            self.heal or shrinks,
            self.results_device,
            self.min_world_size(world) if shrinks else None,
        )

    def _world_size(self, backend: LaunchBackend) -> int:
        if self.processes is not None:
            return self.processes
        if self.cluster is not None:
            # The cluster's GPUs, not this machine's: the backend checks what it has.
            count = self.gpus if self.gpus is not None else backend.gpu_count()
            if count == 0:
                raise ValueError(
                    f"@distributed(cluster={self.cluster!r}) without gpus= or processes= runs "
                    "one rank per GPU of the cluster, but it has no GPU. Use processes=N for N "
                    "CPU ranks."
                )
            return count
        visible = _env.visible_gpu_count()
        if self.gpus is None:
            if visible == 0:
                raise ValueError(
                    "@distributed() runs one rank per visible GPU, but torch sees no GPU here. "
                    "Use @distributed(processes=N) for N CPU ranks."
                )
            return visible
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
        return self.gpus


def check_restarts(value: Any, *, allow_none: bool = False) -> None:
    """``max_restarts``: an integer >= 0 (or ``None``, "no limit", where ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"max_restarts must be an integer >= 0{' or None' if allow_none else ''}, got "
            f"{type(value).__name__} {value!r:.40}"
        )
    if value < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {value!r}")


def _check_rich_output(value: Any) -> None:
    if not isinstance(value, str) or value not in RICH_OUTPUT_MODES:
        raise ValueError(
            f"rich_output must be one of {', '.join(map(repr, RICH_OUTPUT_MODES))} ('rank0': "
            f"rank 0's displays and figures reach the cell, 'all': every rank's, labelled by "
            f"rank, 'none': text only), got {value!r:.40}"
        )


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


def _check_on_hang(value: Any) -> None:
    if value not in ("report", "restart"):
        raise ValueError(
            f"on_hang must be 'report' (warn in the cell and keep waiting) or 'restart' "
            f"(restart the group, counted against max_restarts), got {value!r:.40}"
        )


def _check_cluster(cluster: Any, nodes: Any, runtime_env: Any) -> None:
    if cluster is not None and not isinstance(cluster, str):
        raise TypeError(
            f"cluster must be None or 'ray', got {type(cluster).__name__} {cluster!r:.40}"
        )
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


def _check_bounds(config: LaunchConfig) -> None:
    """``min_gpus``/``min_processes``/``min_nodes``: each with what it bounds, and under it."""
    pairs = (
        ("min_gpus", config.min_gpus, "gpus", config.gpus),
        ("min_processes", config.min_processes, "processes", config.processes),
        ("min_nodes", config.min_nodes, "nodes", config.nodes),
    )
    for name, low, target_name, target in pairs:
        _check_count(name, low)
        if low is None:
            continue
        if target is None and name == "min_gpus" and config.processes is None:
            continue  # every visible GPU, at least this many
        if target is None:
            if name == "min_gpus":
                raise ValueError(
                    f"min_gpus={low} bounds gpus=, but this run asks for processes= (CPU ranks): "
                    f"use min_processes={low}"
                )
            example = {
                "gpus": f"gpus={low + 2}, min_gpus={low}",
                "processes": f"processes={low + 1}, min_processes={low}",
                "nodes": f"cluster='ray', nodes={low + 1}, min_nodes={low}",
            }[target_name]
            raise ValueError(
                f"{name}={low} bounds {target_name}=, which is not given: say how many the run "
                f"asks for and how few it may go on with, e.g. @distributed({example})"
            )
        if target is not None and low > target:
            raise ValueError(
                f"{name}={low} is more than {target_name}={target}: the minimum is the fewest "
                f"{target_name} the run may go on with after losing some, so at most "
                f"{target_name}={target}"
            )
    given = [name for name, low, _, _ in pairs if low is not None]
    if len(given) > 1:
        raise ValueError(
            f"pass one minimum, not {' and '.join(given)}: min_gpus bounds gpus=, "
            "min_processes bounds processes=, min_nodes bounds the Ray nodes="
        )
    value = config.replace_within
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"replace_within must be a number of seconds, got {type(value).__name__} {value!r:.40}"
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"replace_within must be a finite number of seconds >= 0 (how long a lost Ray node "
            f"may take to be replaced before the run goes on without it), got {value!r}"
        )


def _check_count(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
