"""``RankPool``: ranks that stay up between calls, with a namespace each.

The ranks are started by the same backend and rank set-up as ``@distributed``
(:mod:`nbtools.launch.pool._ranks`); what stays alive between calls is the
whole rank: its process group, its device state, its names.

What happens on trouble (the user is always told which it was):

- every rank answered, some with an exception: :class:`DistributedError`;
  the pool and its state are kept;
- a rank failed while peers kept running past a short grace (stuck in a
  collective), or an interrupt left ranks running: the pool is restarted with
  fresh ranks and the message says that rank state was lost;
- a rank died: on local CPU ranks the pool heals in place (``heal=True``, the
  default): the other ranks keep their processes and names, a fresh process
  replaces the dead rank, and the call says which names were lost with it;
  otherwise the pool restarts (fresh state, said so). Either counts against
  ``max_restarts``; past it the pool stops and says how to start it again.

Every restart emits a ``pool_restarted`` event; the rules are in one place,
:mod:`nbtools.launch.pool._restarts`.
"""

from __future__ import annotations

import linecache
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from nbtools import events
from nbtools._internal import hooks
from nbtools.errors import LaunchError
from nbtools.launch import _payload, _sources
from nbtools.launch._config import LaunchConfig, check_restarts
from nbtools.launch._rank import in_rank
from nbtools.launch.pool._errors import failures_of, rank_errors
from nbtools.launch.pool._registry import CallGuard, owned, register, unregister
from nbtools.launch.pool._restarts import Generations, release
from nbtools.launch.pool._waits import (
    RanksHealed,
    RanksHung,
    RanksInterrupted,
    RanksLost,
    RanksStuck,
)

__all__ = ["RankPool"]


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
        output: ``"all"``, ``"rank0"`` or ``"none"``: whose text output the calls show.
        rich_output: ``"rank0"`` (default), ``"all"`` or ``"none"``: whose rich output
            (``display()``, figures, a cell's last value as HTML or PNG) reaches the
            cell; with ``"all"`` each rank's is labelled ``[rank N]``. See
            :func:`nbtools.distributed`.
        hang_timeout: seconds without output after which a call prints every
            rank's stack once (the call goes on); with progress reports, the hang
            bound (see :func:`nbtools.distributed`).
        on_hang: ``"report"`` (default) warns and keeps waiting; ``"restart"``
            ends the call with a ``DistributedError`` naming the hung ranks and
            replaces the ranks with fresh ones (state lost), counted against
            ``max_restarts`` as a rank that died.
        cluster: ``None`` (this machine) or ``"ray"``; ``nodes`` and
            ``runtime_env`` as for ``@distributed``.
        heal: on this machine's CPU ranks, a rank that dies (a signal, the OOM
            killer, ``os._exit``) is replaced in place: the other ranks keep
            their processes, process group and namespaces; the replaced rank
            starts with a new namespace, and the call the death interrupted
            raises a ``DistributedError`` naming the names lost there. Each
            heal counts against ``max_restarts``. ``False``: every rank is
            replaced (state lost), as on GPUs and Ray.

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
        rich_output: str = "rank0",
        on_hang: str = "report",
        heal: bool = True,
    ) -> None:
        if in_rank():
            raise LaunchError(
                "RankPool() was called inside a rank; pools do not nest. This code already "
                "runs on every rank."
            )
        # The same checks and sizes as @distributed with these options.
        config = LaunchConfig(
            processes=processes,
            gpus=gpus,
            output=output,
            hang_timeout=hang_timeout,
            cluster=cluster,
            nodes=nodes,
            runtime_env=runtime_env,
            rich_output=rich_output,
            on_hang=on_hang,
        )
        self._open(config, max_restarts, heal)

    @classmethod
    def from_config(
        cls, config: LaunchConfig, max_restarts: int | None = 3, heal: bool = True
    ) -> RankPool:
        """A pool for a launch configuration already built (``@distributed(keep_alive=True)``).

        The configuration's own ``max_restarts`` (restarts of a plain call's group)
        does not apply: a pool replaces dead ranks up to ``max_restarts`` times.
        """
        if in_rank():
            raise LaunchError(
                "RankPool() was called inside a rank; pools do not nest. This code already "
                "runs on every rank."
            )
        pool = cls.__new__(cls)
        pool._open(config, max_restarts, heal)
        return pool

    def _open(self, config: LaunchConfig, max_restarts: int | None, heal: bool) -> None:
        check_restarts(max_restarts, allow_none=True)
        if not isinstance(heal, bool):
            raise TypeError(f"heal must be True or False, got {type(heal).__name__}")
        self._config = config
        backend = config.backend()
        self._plan = config.plan(backend)
        backend.check(self._plan.world_size, self._plan.use_cuda)
        self._backend = backend
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process the ranks belong to (not a forked child)
        self._closed = False
        self._run_dir = tempfile.mkdtemp(prefix="nbtools-pool-")
        collector = events.Collector(self._run_dir).start()
        self._gens = Generations(
            backend,
            self._plan,
            max_restarts,
            uuid.uuid4().hex[:12],
            self._run_dir,
            collector,
            heal=heal,
        )
        try:
            self._gens.start()
        except BaseException:
            release(backend, collector, self._run_dir)
            raise
        register(self)
        events.emit(
            "launch",
            f"pool of {self.world_size} ranks ({backend.name})",
            world_size=self.world_size,
            cluster=backend.name,
            pool=True,
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
    def max_restarts(self) -> int | None:
        """Replacements of ranks that died before the pool stops (None: no limit)."""
        return self._gens.max_restarts

    @property
    def restarts(self) -> int:
        """How many times the ranks were replaced by fresh ones, whatever the reason."""
        return self._gens.restarts

    @property
    def owner_pid(self) -> int:
        """The process that created the pool: only it may call the ranks or close them."""
        return self._pid

    @property
    def stopped_reason(self) -> str | None:
        """Why the pool gave up after its last restart (``restart()`` starts it again), or None."""
        return self._gens.stopped

    @property
    def call_lock(self) -> threading.Lock:
        """Held for the length of one call: calls from several threads take turns."""
        return self._lock

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, by rank (on their own hosts)."""
        with self._guard():
            return self._gens.live().pids

    def execute(self, code: str) -> list[Any]:
        """Run ``code`` in every rank's namespace; each rank's value of the last expression.

        Returns:
            One entry per rank: the value of ``code``'s last line when it is an
            expression, else None.
        """
        if not isinstance(code, str):
            raise TypeError(f"execute() takes the code as a string, got {type(code).__name__}")
        compile(
            code, "<pool execute>", "exec"
        )  # a syntax error is raised here, before any rank runs
        # A hang report's stacks show the lines of this code, as the ranks' tracebacks do.
        linecache.cache["<pool execute>"] = (
            len(code),
            None,
            code.splitlines(True),
            "<pool execute>",
        )
        replies = self._call("exec", (code, "<pool execute>", "value"), uses=code.encode())
        return self._values(replies)

    def execute_cell(self, code: str, filename: str) -> list[dict[str, str] | None]:
        """Run a notebook cell on every rank; each rank's last value, formatted for display.

        This is what ``%%distributed`` runs. Unlike :meth:`execute`, the value of
        the cell's last expression does not travel back: each rank formats it
        (``repr`` and, where the value has one, ``_repr_html_``), so values that
        cannot be pickled still show.

        Args:
            code: the cell's source.
            filename: the name tracebacks give the cell (``"<distributed In[3]>"``).

        Returns:
            One entry per rank: a MIME bundle (``{"text/plain": ..., "text/html": ...}``)
            of the last expression's value, or None when the cell ends in a
            statement or the value is None.

        Raises:
            SyntaxError: the code does not compile (no rank ran it).
            nbtools.errors.DistributedError: the cell raised on some rank.
        """
        __tracebackhide__ = True
        if not isinstance(code, str):
            raise TypeError(f"execute_cell() takes the code as a string, got {type(code).__name__}")
        compile(code, filename, "exec")
        replies = self._call("exec", (code, filename, "display"), uses=code.encode())
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
        replies = self._call("run", payload, _sources.localizer(fn), uses=payload)
        return self._values(replies)

    def push(self, names: dict[str, Any] | None = None, /, **values: Any) -> None:
        """Set names in every rank's namespace: ``push(lr=0.1)`` or ``push({"lr": 0.1})``."""
        framed = _payload.pack_push(names, values)
        self._call("push", framed, uses=bytes(framed.data))

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
            self._gens.restart()

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
            unregister(self)
            self._gens.close(graceful=acquired)  # not acquired: a call in another thread ends
        finally:
            if acquired:
                self._lock.release()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "stopped" if self._gens.stopped else "running"
        return f"<RankPool {self.world_size} ranks ({self._backend.name}), {state}>"

    # --- the pool's machinery ----------------------------------------------------------

    def _guard(self, restartable: bool = False) -> CallGuard:
        return CallGuard(self, restartable)

    def _call(
        self,
        op: str,
        arg: Any,
        localize: Callable[[str], str] = lambda text: text,
        uses: bytes = b"",
    ) -> dict[int, tuple[str, Any]]:
        """Send one command to every rank; their answers, or the error that ended the call.

        ``uses`` is what the ranks will run (code or a pickled function): the
        integrations of the libraries it uses take part first, as they do before
        a plain call's ranks start (:func:`nbtools._internal.hooks.before_launch`).
        """
        __tracebackhide__ = True
        with self._guard():
            ranks = self._gens.live()
            if uses:
                hooks.before_launch(uses)  # integrations from above (e.g. a new MLflow store)
            ranks.forwarder.localize = localize  # stack dumps name this call's cell code
            try:
                replies = ranks.call(
                    op, arg, self._plan.hang_timeout, ranks.call_setup(), self._plan.on_hang
                )
            except RanksInterrupted as exc:
                self._gens.after_interrupt(exc)
                interrupt = KeyboardInterrupt()
                interrupt.stacks = ranks.forwarder.stacks  # type: ignore[attr-defined]
                raise interrupt from None
            except RanksStuck as exc:
                raise self._gens.after_stuck(exc, localize) from None
            except RanksHealed as exc:
                raise self._gens.after_heal(exc, localize) from None
            except RanksLost as exc:
                raise self._gens.after_loss(exc) from None
            except RanksHung as exc:
                raise self._gens.after_hang(exc, localize) from None
            failures = failures_of(replies, self._gens.restarts, localize)
            if failures:
                raise rank_errors(op, failures) from None
            return replies

    def _values(self, replies: dict[int, tuple[str, Any]]) -> list[Any]:
        blobs = ((rank, replies[rank][1]) for rank in sorted(replies))
        return _payload.unpack_values(blobs, "the value from rank")
