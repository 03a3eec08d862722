"""The Ray launch backend: one actor per rank in a placement group.

Per attempt: reserve the resources (:func:`~nbtools.launch._ray._cluster.place`),
start one :class:`~nbtools.launch._ray._rank.RankActor` per bundle slot, ask
each where it landed, order the ranks by node then lowest GPU id (as Ray
Train does, so LOCAL_RANK and NODE_RANK agree with the hardware), have rank 0
host the ``TCPStore`` on its node's Ray IP, and call ``run`` on every actor.
On GPUs each rank sees every GPU its node gave the group
(``CUDA_VISIBLE_DEVICES`` = the union, so NCCL can use peer links) and uses
its own, which is ``cuda:LOCAL_RANK``.

After a failure every other actor is killed at once (``ray.kill``); actors
and the placement group never outlive the attempt.

What a launch keeps on a node outside its ranks (the memory tier's snapshots,
kept for a restart) ends with the launch on every node it used: the backend's
:meth:`RayBackend.close` runs the launch-end hooks there. The keeper a snapshot
records there is the Ray worker's parent, which outlives the launch, so no later
sweep would. An attempt whose ranks all returned keeps its actors and placement
group until then (or until another attempt starts), and the hooks run in those
processes, already running with the ranks' ``runtime_env`` and imports
(:meth:`RankActor.end_run`), then all go: after the launch's only attempt, every
rank runs the hooks of the packages its code imported (what no rank imported kept
nothing), else one rank per node runs all of them. A node with no such actor (its ranks died, the node was lost and
came back) gets a task, with the ranks' ``runtime_env``, which may have to wait
for Ray to start a worker for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger
from nbtools.errors import LaunchError
from nbtools.events import (
    CHANNEL_ENV,
    NODE_ENV,
    NODE_SEPARATOR,
    add_collectives_asker,
    remove_collectives_asker,
)
from nbtools.launch._backend import Failed, Finished, GroupSpec, Outcome, wait_for_stacks
from nbtools.launch._failures import RankFailure, from_record
from nbtools.launch._ray import _cluster
from nbtools.launch._ray._pump import OutputPump
from nbtools.launch._ray._rank import RankActor

__all__ = ["RayBackend", "RayGroup", "end_run_on_node", "look_at_process"]

_log = get_logger("launch")
_POLL_S = 0.05
# How long the launch-end tasks on the nodes may take, all together.
_END_RUN_S = 120.0
# Output a failed attempt's other ranks may still deliver before they are killed.
_LAST_OUTPUT_S = 1.0
_actor_class: Any = None
_look_task: Any = None
_LOOK_FRESH_S = 5.0  # a look at a rank's process asked for longer ago is not used


def _actor(ray: Any) -> Any:
    global _actor_class
    if _actor_class is None:
        # Threaded: ``output`` and ``stacks`` run while ``run`` is busy.
        _actor_class = ray.remote(max_concurrency=4, max_restarts=0)(RankActor)
    return _actor_class


class RayBackend:
    """Starts ranks as Ray actors; see the module docstring.

    Args:
        nodes: spread the ranks over exactly this many nodes (None: pack them).
        runtime_env: passed to every rank actor as Ray's ``runtime_env``.
    """

    name = "ray"
    remote_nodes = True
    # Rank code runs in an actor thread, which no signal reaches.
    interrupts_blocked_calls = False

    def __init__(self, nodes: int | None = None, runtime_env: dict | None = None) -> None:
        self.nodes = nodes
        self.runtime_env = runtime_env
        #: Seconds spent in each start-up phase of the last attempt (benchmarks read it).
        self.timings: dict[str, float] = {}
        self._nodes: dict[str, set[str]] = {}  # run id: the nodes its ranks ran on
        self._attempts: dict[str, int] = {}  # run id: how many attempts it started
        # run id: the attempts whose ranks all returned, kept for the launch's end (close)
        self._kept: dict[str, list[_Kept]] = {}

    def gpu_count(self) -> int:
        """GPUs of every alive node of the cluster."""
        ray = _cluster.connect()
        return sum(node.gpus for node in _cluster.alive_nodes(ray))

    def check(self, world_size: int, use_cuda: bool) -> None:
        """Connect to the cluster and check that it can hold the ranks."""
        ray = _cluster.connect()
        _cluster.check_capacity(ray, world_size, use_cuda, self.nodes)

    def start(self, spec: GroupSpec) -> RayGroup:
        """Place and start ``spec.world_size`` rank actors and call ``run`` on each."""
        ray = _cluster.connect()
        # An attempt kept for the end hooks is not the last one after all (a pool's fresh
        # ranks): its actors go now, and their resources with them.
        kept, self._kept = self._kept, {}
        for attempts in kept.values():
            for attempt in attempts:
                attempt.end(ray)
        t0 = time.perf_counter()
        group, slots = _cluster.place(ray, spec.world_size, spec.use_cuda, self.nodes)
        self.timings = {"placement": time.perf_counter() - t0}
        actors: list[Any] = []
        try:
            actors = self._actors(ray, group, slots, spec.use_cuda)
            where = _gather(ray, [a.where.remote() for a in actors], "start the rank actors")
            order = _order(where, slots)
            actors = [actors[i] for i in order]
            where = [where[i] for i in order]
            self._nodes.setdefault(spec.run_id, set()).update(w["node_id"] for w in where)
            self._attempts[spec.run_id] = self._attempts.get(spec.run_id, 0) + 1
            store = _gather(ray, [actors[0].host_store.remote(spec.world_size)], "host the store")
            self.timings["actors"] = time.perf_counter() - t0 - self.timings["placement"]
            specs = _rank_specs(spec, where, store[0], _node_names(ray, where))
            ranks = RayGroup(ray, group, actors, where, spec, self.timings, keep=self._keep)
            ranks.begin([a.run.remote(spec.payload, s) for a, s in zip(actors, specs, strict=True)])
            return ranks
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)
            raise

    def _actors(self, ray: Any, group: Any, slots: list[int], use_cuda: bool) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1} if use_cuda else {"num_cpus": 1}
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        cls = _actor(ray)
        return [
            cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle
                ),
                **options,
            ).remote()
            for bundle in slots
        ]

    def _keep(self, run_id: str, kept: _Kept) -> None:
        self._kept.setdefault(run_id, []).append(kept)

    def close(self) -> None:
        """The launch is over: run its end hooks on every node it used (the module docstring),
        then end the actors and placement groups kept for that.

        Nothing else is held between attempts (each attempt places its own ranks).
        """
        runs, self._nodes = self._nodes, {}
        kept, self._kept = self._kept, {}
        started, self._attempts = self._attempts, {}
        if not runs and not kept:
            return
        import ray

        try:
            refs = []
            for run_id, nodes in runs.items():
                only = started.get(run_id, 0) == 1 and len(kept.get(run_id, [])) == 1
                keepers: dict[str, Any] = {}  # node id: a kept rank actor there (lowest rank)
                for attempt in reversed(kept.get(run_id, [])):
                    for actor, info in zip(attempt.actors, attempt.where, strict=True):
                        if only:
                            refs.append(actor.end_run.remote(run_id, True))
                        keepers.setdefault(info["node_id"], actor)
                for node in sorted(nodes):
                    if only and node in keepers:
                        continue  # its ranks ended what their code made there
                    if node in keepers:
                        refs.append(keepers[node].end_run.remote(run_id))
                    elif _cluster.node_answers(ray, node):  # else gone, and its memory with it
                        refs.append(self._end_run_task(ray, node, run_id))
            ray.get(refs, timeout=_END_RUN_S)
        except Exception as exc:  # noqa: BLE001 - the launch's outcome stands; say what is left
            _log.warning(
                "the launch's memory snapshots may remain on some of its %d nodes: their "
                "clean-up did not finish (%s: %s)",
                len({n for nodes in runs.values() for n in nodes}),
                type(exc).__name__,
                exc,
            )
        finally:
            for attempts in kept.values():
                for attempt in attempts:
                    attempt.end(ray)

    def _end_run_task(self, ray: Any, node: str, run_id: str) -> Any:
        """Run the launch-end hooks on ``node`` in a task (no rank actor is left there)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=1)(end_run_on_node)
        # A runtime_env of variables only is passed as they are: the task then runs in a
        # worker the node already has, instead of waiting for one started for that env.
        runtime_env = self.runtime_env or {}
        env = dict(runtime_env.get("env_vars") or {})
        own_env = bool(runtime_env) and set(runtime_env) != {"env_vars"}
        options: dict[str, Any] = {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)
        }
        if own_env:
            options["runtime_env"] = self.runtime_env
        return task.options(**options).remote(run_id, {} if own_env else env)


@dataclasses.dataclass(frozen=True)
class _Kept:
    """An attempt whose ranks all returned: its actors (rank order), where each runs, and
    its placement group, kept until the launch's end hooks have run."""

    actors: list[Any]
    where: list[dict]
    group: Any

    def end(self, ray: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)


def look_at_process(pid: int, tid: int) -> tuple[float, int, str, str] | None:
    """On a rank's node: its process tree's CPU seconds and I/O bytes, and its thread
    ``tid``'s state (:mod:`nbtools.events._probe`); None when the process is gone."""
    from nbtools.events import _probe

    used = _probe.usage(pid)
    if used is None:
        return None
    kind, detail = _probe.sample(pid, tid)
    return used[0], used[1], kind, detail


def end_run_on_node(run_id: str, env: dict[str, str]) -> None:
    """In a Ray task on one node: run the launch-end hooks for ``run_id`` there, with the
    variables of the ranks' ``runtime_env`` (``env``) set as the ranks had them."""
    import os

    # Importing this module imported the package first, whose top registered the hooks.
    from nbtools._internal import hooks

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        hooks.launch_ended(run_id)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _gather(ray: Any, refs: list, what: str) -> list:
    """``ray.get`` that stays interruptible and turns actor start failures into LaunchError."""
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as exc:
        text = str(exc).strip().splitlines()
        raise LaunchError(
            f"the Ray cluster could not {what}: {text[-1] if text else exc!r}. If a module is "
            "missing on the nodes, pass runtime_env={'pip': [...]} (or install it there)."
        ) from exc


def _order(where: list[dict], slots: list[int]) -> list[int]:
    """Actor indices sorted by node (in bundle order of first use), then lowest GPU id."""
    first_slot: dict[str, int] = {}
    for index, info in enumerate(where):
        first_slot.setdefault(info["node_id"], slots[index])

    def key(index: int) -> tuple:
        gpus = [int(g) for g in where[index]["gpus"] if str(g).isdigit()]
        return (first_slot[where[index]["node_id"]], min(gpus) if gpus else 0, index)

    return sorted(range(len(where)), key=key)


def _node_names(ray: Any, where: list[dict]) -> dict[str, str]:
    """``{node id: label}``: the host name, plus the node id's start where hosts share it.

    The same labels as the GPU pane's; a rank's events and hang flags name its node so.
    """
    hosts: dict[str, set[str]] = {}
    for node in _cluster.alive_nodes(ray):
        hosts.setdefault(node.host, set()).add(node.node_id)
    for info in where:
        hosts.setdefault(info["host"], set()).add(info["node_id"])
    return {
        info["node_id"]: info["host"]
        if len(hosts[info["host"]]) == 1
        else f"{info['host']}{NODE_SEPARATOR}{info['node_id'][:8]}"
        for info in where
    }


def _rank_specs(
    spec: GroupSpec, where: list[dict], store: tuple[str, int], names: dict[str, str]
) -> list[dict]:
    """Each rank's environment and settings, as torchrun would set them on a multi-node run."""
    node_ids = list(dict.fromkeys(info["node_id"] for info in where))
    local_counts = {n: sum(1 for w in where if w["node_id"] == n) for n in node_ids}
    node_gpus = {
        n: sorted(
            {g for w in where if w["node_id"] == n for g in w["gpus"]}, key=lambda g: (len(g), g)
        )
        for n in node_ids
    }
    seen: dict[str, int] = {}
    specs = []
    base = {k: v for k, v in spec.env.items() if k != CHANNEL_ENV}
    for rank, info in enumerate(where):
        node = info["node_id"]
        local = seen.get(node, 0)
        seen[node] = local + 1
        node_rank = node_ids.index(node)
        env = dict(base)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local),
            GROUP_RANK=str(node_rank),
            NODE_RANK=str(node_rank),
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            WORLD_SIZE=str(spec.world_size),
            LOCAL_WORLD_SIZE=str(local_counts[node]),
            ROLE_WORLD_SIZE=str(spec.world_size),
            GROUP_WORLD_SIZE=str(len(node_ids)),
            MASTER_ADDR=store[0],
            MASTER_PORT=str(store[1]),
            TORCHELASTIC_RUN_ID=spec.run_id,
            TORCHELASTIC_RESTART_COUNT=str(spec.restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_USE_AGENT_STORE="False",
            NBTOOLS_NODE_ID=node,
        )
        env[NODE_ENV] = names[node]
        device = None
        if spec.use_cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus[node])
            device = node_gpus[node].index(info["gpus"][0]) if info["gpus"] else local
        else:
            env["ACCELERATE_USE_CPU"] = "true"
        if _is_loopback(info["ip"]):
            # A cluster on one machine: keep gloo and nccl on the loopback interface.
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        specs.append(
            {
                "rank": rank,
                "world_size": spec.world_size,
                "backend": spec.backend,
                "device": device,
                "store": store,
                "env": env,
            }
        )
    return specs


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


class RayGroup:
    """One attempt's rank actors; implements :class:`~nbtools.launch._backend.RankGroup`."""

    def __init__(
        self,
        ray: Any,
        group: Any,
        actors: list[Any],
        where: list[dict],
        spec: GroupSpec,
        timings: dict[str, float],
        keep: Callable[[str, _Kept], None] | None = None,
    ) -> None:
        self._ray = ray
        self._keep = keep  # takes the actors and placement group once every rank returned
        self._group = group
        self._actors = actors
        self._where = where
        self._spec = spec
        self._timings = timings
        self._pump = OutputPump(ray, actors, spec.attempt_dir)
        self.stdouts, self.stderrs = self._pump.stdouts, self._pump.stderrs
        self._runs: dict[Any, int] = {}
        self._results: dict[int, dict] = {}
        self._failures: dict[int, RankFailure] = {}
        self._stopped = False
        self._closed = False
        self._outcome: Outcome | None = None
        self._looks: dict[int, tuple[float, Any]] = {}  # rank -> (asked when, the look)

    def begin(self, runs: list[Any]) -> None:
        self._runs = {ref: rank for rank, ref in enumerate(runs)}
        self._pump.start()
        add_collectives_asker(self._ask_collectives)  # hang reports reach the actors

    def _ask_collectives(self) -> int:
        """Have each running rank's actor ask it which collective it is in; returns how many."""
        running = [a for r, a in enumerate(self._actors) if r not in self._results]
        for actor in running:
            actor.ask_collectives.remote()  # the answer travels with the rank's events
        return len(running)

    def look_at(self, rank: int, tid: int = 0) -> tuple[float, int, str, str] | None:
        """A look at rank ``rank``'s process from its own node, for the watchdog.

        A rank reports what its probe sees of itself, but a probe cannot run while the
        rank's training thread holds the GIL (a long C call): the kernel on another
        machine then hears nothing. A task on the rank's node reads its process from
        outside: ``(CPU seconds and bytes read and written of its process tree, its
        thread ``tid``'s state and a word)`` (:func:`look_at_process`). Never blocks:
        returns the look that came back since the last call, if it was asked for within
        the last few seconds, and starts the next one; None while one is in flight, or
        when it failed. A first call only starts one: the node then has a worker for
        the looks before they are needed.
        """
        global _look_task
        seen = None
        asked = self._looks.pop(rank, None)
        if asked is not None:
            at, pending = asked
            ready, _ = self._ray.wait([pending], timeout=0)
            if not ready:
                self._looks[rank] = asked
                return None
            if time.monotonic() - at <= _LOOK_FRESH_S:  # an older one says nothing of now
                with contextlib.suppress(Exception):  # the node or its worker is gone
                    seen = self._ray.get(pending, timeout=0)
        if self._stopped:
            return seen
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if _look_task is None:
            _look_task = self._ray.remote(num_cpus=0, max_retries=0)(look_at_process)
        info = self._where[rank]
        strategy = NodeAffinitySchedulingStrategy(info["node_id"], soft=False)
        pending = _look_task.options(scheduling_strategy=strategy).remote(info["pid"], tid)
        self._looks[rank] = (time.monotonic(), pending)
        return seen

    def node_label(self, rank: int) -> str:
        """Where rank ``rank`` runs, for messages."""
        info = self._where[rank]
        return f"{info['host']} ({info['node_id'][:8]}, {info['ip']})"

    def poll(self) -> Outcome | None:
        if self._outcome is not None:
            return self._outcome
        ray = self._ray
        pending = [ref for ref, rank in self._runs.items() if rank not in self._results]
        if pending:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in ready:
                self._collect(self._runs[ref], ref)
        if self._failures:
            self._outcome = self._fail()
            return self._outcome
        if len(self._results) < len(self._actors):
            time.sleep(_POLL_S)
            return None
        if not all(self._pump.finished(r) for r in range(len(self._actors))):
            time.sleep(_POLL_S)
            return None
        self._timings.update(_rank_timings(self._results))
        self._outcome = Finished([self._results[r]["ok"] for r in range(len(self._actors))])
        return self._outcome

    def _collect(self, rank: int, ref: Any) -> None:
        ray = self._ray
        try:
            answer = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._failures[rank] = self._died(rank, exc)
            self._results[rank] = {}
            return
        self._results[rank] = answer
        if "failure" in answer:
            failure = from_record(answer["failure"], self._spec.restart_count)
            self._failures[rank] = _with_node(failure, self.node_label(rank))

    def _died(self, rank: int, exc: Exception) -> RankFailure:
        node = self._where[rank]["node_id"]
        label = self.node_label(rank)
        if not _cluster.node_answers(self._ray, node):
            kind, message = "NodeLost", "its node was lost (Ray reports the node dead)"
        else:
            reason = _ray_reason(exc)
            kind = "ActorDied"
            message = "its actor process died without raising an exception"
            message += f" ({reason})" if reason else ""
        return RankFailure(
            rank, kind, message, "", None, self._spec.restart_count, time.time(), node=label
        )

    def _fail(self) -> Failed:
        failed = set(self._failures)
        others = [r for r in range(len(self._actors)) if r not in self._results]
        # What the other ranks wrote up to now still reaches the cell, then they go.
        deadline = time.monotonic() + _LAST_OUTPUT_S
        while others and time.monotonic() < deadline:
            if all(self._pump.finished(r) for r in range(len(self._actors)) if r in failed):
                break
            time.sleep(_POLL_S)
        self.stop()
        returned = frozenset(r for r, a in self._results.items() if "ok" in a)
        first = min(self._failures.values(), key=lambda f: (f.time or 0.0, f.rank)).rank
        return Failed(dict(self._failures), first, returned)

    def show_stacks(self, last_output: Callable[[], float]) -> None:
        running = [a for r, a in enumerate(self._actors) if r not in self._results]
        if not running:
            return
        start = time.monotonic()
        for actor in running:
            actor.stacks.remote()
        wait_for_stacks(last_output, start, _POLL_S * 2)

    def _kept(self) -> bool:
        """Whether the actors outlive this attempt: every rank returned, and the backend
        takes them for the launch's end hooks (they run nothing any more)."""
        return self._keep is not None and isinstance(self._outcome, Finished)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        remove_collectives_asker(self._ask_collectives)
        if self._kept():
            return  # nothing runs: close() hands the actors on
        for rank, actor in enumerate(self._actors):
            if rank not in self._results:
                self._pump.give_up(rank)
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
        self._remove_group()

    def close(self) -> dict[int, list[str]]:
        if self._closed:
            return {}
        self._closed = True
        self.stop()
        self._pump.stop()
        if self._kept():
            assert self._keep is not None
            self._keep(self._spec.run_id, _Kept(list(self._actors), list(self._where), self._group))
        return {r: a["left"] for r, a in self._results.items() if a.get("left")}

    def _remove_group(self) -> None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(self._group)


def _with_node(failure: RankFailure, label: str) -> RankFailure:
    return dataclasses.replace(failure, node=label)


def _ray_reason(exc: Exception) -> str:
    """Ray's own words on why an actor died, shortened to its most telling line."""
    for line in str(exc).splitlines():
        line = line.strip()
        if "exit detail" in line.lower() or "signal" in line.lower() or "killed" in line.lower():
            return line[:300]
    return ""


def _rank_timings(results: dict[int, dict]) -> dict[str, float]:
    """Slowest rank's time to form the group and to run the function (seconds)."""
    out: dict[str, float] = {}
    spans = [r.get("timings", {}) for r in results.values()]
    groups = [t["group"] - t["start"] for t in spans if "group" in t and "start" in t]
    funcs = [t["function"] - t["group"] for t in spans if "function" in t and "group" in t]
    if groups:
        out["process_group"] = max(groups)
    if funcs:
        out["function"] = max(funcs)
    return out
