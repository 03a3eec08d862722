"""``RankPool``: ranks that stay up between calls, with a namespace each.

The ranks are started by the same backend and rank set-up as ``@distributed``
(:mod:`nbtools.launch._pool_ranks`); what stays alive between calls is the
whole rank: its process group, its device state, its names.

What happens on trouble (the user is always told which it was):

- every rank answered, some with an exception: :class:`DistributedError`;
  the pool and its state are kept;
- a rank failed while peers kept running past a short grace (stuck in a
  collective), or an interrupt left ranks running: the pool is restarted with
  fresh ranks and the message says that rank state was lost;
- a rank died: the pool restarts (fresh state, said so) up to
  ``max_restarts`` times, then stops and says how to start it again.

Every restart emits a ``pool_restarted`` event.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError, LaunchError
from nbtools.launch import _inrank, _payload, _sources
from nbtools.launch._backend import GroupSpec
from nbtools.launch._config import LaunchConfig, check_restarts
from nbtools.launch._failures import RankFailure, describe, forms_again
from nbtools.launch._pool_errors import failures_of, first, plural, rank_errors, ranks_text
from nbtools.launch._pool_ranks import (
    INTERRUPT_GRACE_S,
    PEER_GRACE_S,
    Ranks,
    RanksInterrupted,
    RanksLost,
    RanksStuck,
)
from nbtools.launch._pool_registry import (
    CallGuard,
    open_pools,
    owned,
    register,
    shutdown,
    unregister,
)

__all__ = ["RankPool", "shutdown", "open_pools"]

_log = get_logger("launch")
_LOST = "rank state (names, models, tensors) was lost"


class RankPool:
    """Ranks that stay alive between calls, each with a persistent namespace.

    The ranks are set up exactly as ``@distributed`` sets them up (environment,
    device, default process group) and keep all of it between calls: the
    process group, what is on the device, and the names in their namespace.

    Args:
        processes: this many CPU ranks with a ``gloo`` group.
        gpus: one rank per GPU on this many GPUs (``cpu:gloo,cuda:nccl``).
            Neither: every visible GPU.
        max_restarts: how many times ranks that died are replaced by fresh
            ones (state lost) before the pool stops; ``None``: no limit.
        output: ``"all"``, ``"rank0"`` or ``"none"``: whose output the calls show.
        hang_timeout: seconds without output after which a call prints every
            rank's stack once (the call goes on).
        cluster: ``None`` (this machine) or ``"ray"``; ``nodes`` and
            ``runtime_env`` as for ``@distributed``.

    Example:
        >>> with RankPool(processes=2) as pool:  # doctest: +SKIP
        ...     pool.execute("import torch\\nw = torch.ones(2)")
        ...     pool.push(lr=0.1)
        ...     pool.execute("w * lr")
        [tensor([0.1000, 0.1000]), tensor([0.1000, 0.1000])]
    """

    def __init__(
        self,
        *,
        processes: int | None = None,
        gpus: int | None = None,
        max_restarts: int | None = 3,
        output: str = "all",
        hang_timeout: float | None = None,
        cluster: str | None = None,
        nodes: int | None = None,
        runtime_env: dict | None = None,
    ) -> None:
        if _inrank.in_rank():
            raise LaunchError(
                "RankPool() was called inside a rank; pools do not nest. This code already "
                "runs on every rank."
            )
        # The same checks and sizes as @distributed with these options.
        config = LaunchConfig(
            processes=processes, gpus=gpus, output=output, hang_timeout=hang_timeout,
            cluster=cluster, nodes=nodes, runtime_env=runtime_env,
        )
        self._open(config, max_restarts)

    @classmethod
    def from_config(cls, config: LaunchConfig, max_restarts: int | None = 3) -> RankPool:
        """A pool for a launch configuration already built (``@distributed(keep_alive=True)``).

        The configuration's own ``max_restarts`` (restarts of a plain call's group)
        does not apply: a pool replaces dead ranks up to ``max_restarts`` times.
        """
        if _inrank.in_rank():
            raise LaunchError(
                "RankPool() was called inside a rank; pools do not nest. This code already "
                "runs on every rank."
            )
        pool = cls.__new__(cls)
        pool._open(config, max_restarts)
        return pool

    def _open(self, config: LaunchConfig, max_restarts: int | None) -> None:
        check_restarts(max_restarts, allow_none=True)
        self._config = config
        self.max_restarts = max_restarts
        self._backend = self._config.backend()
        self._plan = self._config.plan(self._backend)
        self._backend.check(self._plan.world_size, self._plan.use_cuda)
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process the ranks belong to (not a forked child)
        self._ranks: Ranks | None = None
        self._closed = False
        self._stopped: str | None = None  # why the pool gave up, after its last restart
        self.restarts = 0  # every replacement of the ranks, whatever the reason
        self._deaths = 0  # replacements after ranks died (bounded by max_restarts)
        self._generation = 0
        self._run_id = uuid.uuid4().hex[:12]
        self._run_dir = tempfile.mkdtemp(prefix="nbtools-pool-")
        self._collector = events.Collector(self._run_dir).start()
        try:
            self._start()
        except BaseException:
            self._release()
            raise
        register(self)
        events.emit(
            "launch", f"pool of {self.world_size} ranks ({self._backend.name})",
            world_size=self.world_size, cluster=self._backend.name, pool=True,
        )

    # --- public calls ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._plan.world_size

    @property
    def closed(self) -> bool:
        """True once :meth:`close` (or ``distributed.shutdown()``) ended the pool."""
        return self._closed

    @property
    def owner_pid(self) -> int:
        """The process that created the pool: only it may call the ranks or close them."""
        return self._pid

    @property
    def stopped_reason(self) -> str | None:
        """Why the pool gave up after its last restart (``restart()`` starts it again), or None."""
        return self._stopped

    @property
    def call_lock(self) -> threading.Lock:
        """Held for the length of one call: calls from several threads take turns."""
        return self._lock

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, by rank (on their own hosts)."""
        with self._guard():
            return self._live().pids

    def execute(self, code: str) -> list[Any]:
        """Run ``code`` in every rank's namespace; each rank's value of the last expression.

        Returns:
            One entry per rank: the value of ``code``'s last line when it is an
            expression, else None.
        """
        if not isinstance(code, str):
            raise TypeError(f"execute() takes the code as a string, got {type(code).__name__}")
        compile(code, "<pool execute>", "exec")  # a syntax error is raised here, before any rank runs
        return self._values(self._call("exec", (code, "<pool execute>", "value")))

    def _execute_display(self, code: str, filename: str) -> list[dict[str, str] | None]:
        """Run a cell on every rank; each rank's last value formatted for display (or None)."""
        replies = self._call("exec", (code, filename, "display"))
        return [replies[rank][1] for rank in sorted(replies)]

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; one result per rank.

        A function defined in the notebook (``__main__``) runs with the rank's
        namespace as its globals: it sees what ``execute``, ``push`` and
        ``%%distributed`` created, and its ``global`` assignments stay there.
        Notebook names it uses that the rank does not have are brought along.
        """
        if not callable(fn):
            raise TypeError(f"run() takes a function, got {type(fn).__name__} {fn!r:.60}")
        payload = _payload.pack(fn, args, kwargs)
        replies = self._call("run", payload, _sources.localizer(fn))
        return self._values(replies)

    def push(self, names: dict[str, Any] | None = None, /, **values: Any) -> None:
        """Set names in every rank's namespace: ``push(lr=0.1)`` or ``push({"lr": 0.1})``."""
        self._call("push", _payload.pack_push(names, values))

    def pull(self, *names: str) -> Any:
        """Values of names in every rank's namespace.

        Returns:
            For one name, a list with one value per rank; for several, a tuple
            of such lists, one per name.
        """
        if not names:
            raise TypeError("pull() takes at least one name, as in pull('loss')")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"pull(): {name!r} is not a Python name")
        rows = self._values(self._call("pull", list(names)))
        columns = tuple([row[i] for row in rows] for i in range(len(names)))
        return columns[0] if len(names) == 1 else columns

    def status(self) -> list[dict[str, Any]]:
        """Per rank: pid, host, ``uptime_s``, ``rss`` and, on GPUs, device memory in bytes."""
        rows = [data for _, (_, data) in sorted(self._call("status", None).items())]
        now = time.time()
        for row in rows:
            row["uptime_s"] = max(0.0, now - row.pop("started"))
        return rows

    def restart(self) -> None:
        """Replace every rank by a fresh one (state lost); also after the pool stopped."""
        with self._guard(restartable=True):
            self._stopped = None
            self._deaths = 0
            self._replace("restart requested", graceful=True)
            _log.warning("the pool restarted %d fresh ranks: %s", self.world_size, _LOST)

    def close(self) -> None:
        """Stop every rank and release everything; idempotent.

        In a process forked from the pool's own, the pool is only marked closed
        there: the ranks and files belong to the parent.
        """
        if self._closed:
            return
        if not owned(self):
            self._closed = True
            return
        acquired = self._lock.acquire(timeout=1.0)
        try:
            self._closed = True
            ranks, self._ranks = self._ranks, None
            if ranks is not None:
                if acquired:
                    ranks.stop()
                else:
                    ranks.kill()  # a call is running in another thread: it ends with an error
        finally:
            self._release()
            if acquired:
                self._lock.release()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "stopped" if self._stopped else "running"
        return f"<RankPool {self.world_size} ranks ({self._backend.name}), {state}>"

    # --- the pool's machinery ----------------------------------------------------------

    def _guard(self, restartable: bool = False) -> CallGuard:
        return CallGuard(self, restartable)

    def _live(self) -> Ranks:
        if self._ranks is None:
            self._start()  # a restart that was interrupted: start now
        assert self._ranks is not None
        return self._ranks

    def _call(
        self, op: str, arg: Any, localize: Callable[[str], str] = lambda text: text
    ) -> dict[int, tuple[str, Any]]:
        __tracebackhide__ = True
        with self._guard():
            ranks = self._live()
            ranks.forwarder.localize = localize  # stack dumps name this call's cell code
            try:
                replies = ranks.call(op, arg, self._plan.hang_timeout)
            except RanksInterrupted as exc:
                self._after_interrupt(exc)
                raise KeyboardInterrupt from None
            except RanksStuck as exc:
                failures = failures_of(exc.replies, self.restarts, localize)
                message = describe(failures, first(failures)) + (
                    f"\n\nrank{plural(exc.pending)} {ranks_text(exc.pending)} did not finish within "
                    f"{PEER_GRACE_S:.0f} s after that (waiting for the failed rank in a "
                    "collective?); " + self._replace("ranks stuck after a failure")
                )
                raise DistributedError(message, failures) from None
            except RanksLost as exc:
                raise self._after_loss(exc, localize) from None
            failures = failures_of(replies, self.restarts, localize)
            if failures:
                raise rank_errors(op, failures) from None
            return replies

    def _after_interrupt(self, exc: RanksInterrupted) -> None:
        if exc.kept:
            _log.warning(
                "interrupted: every rank stopped its work (KeyboardInterrupt there) and is idle "
                "again; the pool and its state were kept"
            )
            return
        note = self._replace("ranks did not stop after an interrupt")
        why = ""
        if not self._backend.interrupts_blocked_calls:
            why = (
                f" (on {self._backend.name} a rank runs your code in an actor thread, which no signal "
                "reaches: "
                "an interrupt stops Python code "
                "there, but not a call blocked in time.sleep, I/O or C code; such cells can "
                "wait in short steps, e.g. a loop of time.sleep(0.1))"
            )
        _log.warning(
            "interrupted: rank%s %s did not stop within %.0f s%s; %s",
            plural(exc.pending), ranks_text(exc.pending), INTERRUPT_GRACE_S, why, note,
        )

    def _after_loss(self, exc: RanksLost, localize: Callable[[str], str]) -> DistributedError:
        outcome = exc.outcome
        if outcome is None or not outcome.failures:
            failures: dict[int, RankFailure] = {}
            headline = "the pool's ranks ended unexpectedly"
        else:
            failures = outcome.failures
            headline = describe(failures, outcome.first, returned=outcome.returned)
        self._deaths += 1
        if self.max_restarts is not None and self._deaths > self.max_restarts:
            self._stopped = (
                f"the pool stopped after its ranks died {self._deaths} times "
                f"(max_restarts={self.max_restarts})"
            )
            self._discard()
            note = self._stopped + "; call pool.restart() (%distributed restart) to start fresh ranks"
            events.emit("failure", headline.splitlines()[0], pool=True)
        else:
            note = self._replace("a rank died")
        return DistributedError(f"{headline}\n\n{note}", failures)

    def _values(self, replies: dict[int, tuple[str, Any]]) -> list[Any]:
        blobs = ((rank, replies[rank][1]) for rank in sorted(replies))
        return _payload.unpack_values(blobs, "the value from rank")

    def _start(self) -> None:
        regroups = 0
        while True:
            attempt_dir = os.path.join(self._run_dir, f"attempt{self._generation}")
            self._generation += 1
            os.mkdir(attempt_dir)
            spec = GroupSpec(
                payload=b"",
                world_size=self._plan.world_size,
                use_cuda=self._plan.use_cuda,
                run_id=self._run_id,
                restart_count=self.restarts,
                max_restarts=self.max_restarts if self.max_restarts is not None else 2**31 - 1,
                attempt_dir=attempt_dir,
                env=self._collector.environment(),
            )
            try:
                self._ranks = Ranks.start(self._backend, spec, self._plan.output)
                return
            except RanksLost as exc:
                outcome = exc.outcome
                failures = outcome.failures if outcome is not None else {}
                first = failures.get(outcome.first) if outcome and outcome.first is not None else None
                if forms_again(first, regroups):
                    regroups += 1
                    continue
                text = describe(failures, outcome.first) if failures else "the ranks ended"
                raise LaunchError(f"the pool's ranks could not start: {text}") from None

    def _replace(self, reason: str, graceful: bool = False) -> str:
        """Start fresh ranks in place of the current ones; the sentence that tells the user."""
        self._discard(graceful)
        self.restarts += 1
        events.emit(
            "pool_restarted", f"{reason}; {_LOST}", reason=reason, restarts=self.restarts,
            world_size=self.world_size,
        )
        self._start()
        return f"the pool restarted with {self.world_size} fresh ranks: {_LOST}"

    def _discard(self, graceful: bool = False) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            if graceful:
                ranks.stop()
            else:
                ranks.kill()
        self._collector.drain()

    def _release(self) -> None:
        unregister(self)
        try:
            self._collector.stop()
            self._backend.close()
        finally:
            shutil.rmtree(self._run_dir, ignore_errors=True)
