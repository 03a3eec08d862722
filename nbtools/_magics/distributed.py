"""``%distributed`` and ``%%distributed``: a pool of ranks that cells run on.

``%distributed start --processes 2`` (or ``--gpus N``) starts a
:class:`~nbtools.launch.RankPool`; a ``%%distributed`` cell then runs on every
rank, in the rank's own namespace, which persists from cell to cell. The
output of every rank streams into the cell with ``[rank N]`` prefixes, and the
value of the cell's last expression is shown once per rank, formatted on the
rank (a CUDA tensor stays on its device). ``stop``, ``status``, ``restart``,
``push NAME...`` and ``pull NAME...`` complete the set.

Importing this module imports IPython only; torch and the launcher are
imported when a magic first runs.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from nbtools._magics._cells import cell_number, strip_comment

__all__ = ["DistributedMagics", "format_status"]

_USAGE = (
    "%distributed start [--processes N | --gpus N] [--max-restarts K] [--no-heal] [--cluster ray] "
    "[--nodes N] [--output all|rank0|none] [--rich-output rank0|all|none] | stop | status | restart | push NAME... | "
    "pull NAME..."
)
_NO_POOL = "no pool is running: start one with %distributed start --processes N (or --gpus N)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"distributed: {message}. Usage: {_USAGE}")


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_count.__name__ = "integer"


def _parser() -> _Parser:
    parser = _Parser(prog="%distributed", add_help=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in ("start", "restart"):
        start = sub.add_parser(name, add_help=False)
        start.add_argument("--processes", type=_count, default=None)
        start.add_argument("--gpus", type=_count, default=None)
        start.add_argument("--max-restarts", type=_count, default=3, dest="max_restarts")
        start.add_argument("--no-heal", action="store_false", dest="heal")
        start.add_argument("--cluster", choices=["ray"], default=None)
        start.add_argument("--nodes", type=_count, default=None)
        start.add_argument("--output", choices=["all", "rank0", "none"], default="all")
        start.add_argument("--hang-timeout", type=float, default=None, dest="hang_timeout")
        start.add_argument(
            "--rich-output", choices=["rank0", "all", "none"], default="rank0", dest="rich_output"
        )
    sub.add_parser("stop", add_help=False)
    sub.add_parser("status", add_help=False)
    for name in ("push", "pull"):
        sub.add_parser(name, add_help=False).add_argument("names", nargs="+", metavar="NAME")
    return parser


@magics_class
class DistributedMagics(Magics):
    """``%distributed`` / ``%%distributed``; one instance per shell, holding its pool."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.pool: Any = None
        self._options: dict[str, Any] | None = None

    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        """Run cells on a pool of persistent ranks.

        Line: ``%distributed start [--processes N | --gpus N] [--max-restarts K]
        [--no-heal] [--cluster ray] [--nodes N] [--output all|rank0|none]
        [--rich-output rank0|all|none]``, ``stop``,
        ``status``, ``restart [options]``, ``push NAME...`` (notebook variables to
        every rank), ``pull NAME...`` (binds NAME in the notebook to a list with
        each rank's value, and returns it; several names: one list per name).
        A trailing ``# comment`` is ignored, on the line and on ``%%distributed``.

        Cell: ``%%distributed`` runs the cell on every rank, in the rank's own
        namespace; names persist from cell to cell, output is prefixed
        ``[rank N]``, and the last expression's value is shown for each rank
        (end the cell with ``;`` to hide it).

        A rank that dies (SIGKILL, the OOM killer) on this machine's CPU ranks is
        healed in place: the other ranks keep their processes and names, the dead
        rank is replaced by a fresh process with a new namespace, and the cell
        says which names were lost there. ``--no-heal`` replaces every rank instead.
        """
        __tracebackhide__ = True
        line = strip_comment(line)  # "%distributed stop  # done" as IPython's magics take it
        if cell is not None:
            if line:
                raise UsageError(f"%%distributed takes no options, got {line!r}")
            return self._cell(cell)
        try:
            args = _parser().parse_args(shlex.split(line))
        except ValueError as exc:
            raise UsageError(f"distributed: {exc}. Usage: {_USAGE}") from None
        return getattr(self, "_" + args.command)(args)

    # --- line commands -------------------------------------------------------------

    def _start(self, args: argparse.Namespace) -> None:
        options = _options(args)
        if self._running():
            if options == self._options:
                _say(f"a pool of {self.pool.world_size} ranks is already running")
                return
            raise UsageError(
                f"a pool of {self.pool.world_size} ranks is already running with other options; "
                "stop it first (%distributed stop), or %distributed restart with the new options"
            )
        self._open(options)

    def _restart(self, args: argparse.Namespace) -> None:
        options = _options(args)
        if options == _options(_parser().parse_args(["restart"])) and self._options is not None:
            options = self._options  # a plain restart keeps the options of the last start
        if self._running() and options == self._options:
            self.pool.restart()
            _say(f"restarted {self.pool.world_size} fresh ranks (their state was lost)")
            return
        self._stop(args, quiet=True)
        self._open(options)

    def _open(self, options: dict[str, Any]) -> None:
        from nbtools.launch import RankPool

        try:
            self.pool = RankPool(**options)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"distributed start: {exc}") from None
        self._options = options
        _say(f"started {self.pool.world_size} ranks")

    def _stop(self, args: argparse.Namespace, quiet: bool = False) -> None:
        pool, self.pool = self.pool, None
        if pool is None or pool.closed:
            if not quiet:
                _say("no pool is running")
            return
        pool.close()
        if not quiet:
            _say(f"stopped {pool.world_size} ranks")

    def _status(self, args: argparse.Namespace) -> None:
        if not self._running():
            _say("no pool is running")
            return
        display({"text/plain": format_status(self.pool, self.pool.status())}, raw=True)

    def _push(self, args: argparse.Namespace) -> None:
        pool = self._require()
        missing = [name for name in args.names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(
                f"distributed push: no variable {', '.join(map(repr, missing))} in the notebook"
            )
        from nbtools.errors import PicklingError

        try:
            pool.push({name: self.shell.user_ns[name] for name in args.names})
        except (PicklingError, ValueError) as exc:
            raise UsageError(f"distributed {exc}") from None

    def _pull(self, args: argparse.Namespace) -> Any:
        pool = self._require()
        from nbtools.errors import PicklingError

        try:
            values = pool.pull(*args.names)
        except (NameError, PicklingError, ValueError) as exc:
            raise UsageError(f"distributed pull: {exc}") from None
        columns = [values] if len(args.names) == 1 else list(values)
        for name, column in zip(args.names, columns, strict=True):
            self.shell.user_ns[name] = column
        names = ", ".join(args.names)
        are = "is now a list" if len(args.names) == 1 else "are now lists"
        _say(f"{names} {are} in the notebook, one value per rank ({len(columns[0])} ranks)")
        return values

    # --- cells -------------------------------------------------------------------------

    def _cell(self, cell: str) -> None:
        __tracebackhide__ = True
        pool = self._require()
        filename = f"<distributed In[{cell_number(self.shell)}]>"
        compile(cell, filename, "exec")  # a syntax error is shown here, before any rank runs
        from nbtools.errors import DistributedError

        try:
            bundles = pool.execute_cell(cell, filename)
        except DistributedError as exc:
            # IPython shows this instead of the kernel-side frames: the ranks' story only.
            text = f"{type(exc).__name__}: {exc}"
            exc._render_traceback_ = text.splitlines  # type: ignore[attr-defined]
            raise
        if _quiet(cell):
            return
        for rank, bundle in enumerate(bundles):
            if bundle is None:
                continue
            shown = dict(bundle)
            shown["text/plain"] = f"[rank {rank}] {bundle['text/plain']}"
            if "text/html" in shown:
                shown["text/html"] = f"<div><code>[rank {rank}]</code></div>{bundle['text/html']}"
            display(shown, raw=True)

    def _running(self) -> bool:
        return self.pool is not None and not self.pool.closed

    def _require(self) -> Any:
        if not self._running():
            raise UsageError(_NO_POOL)
        return self.pool


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "processes": args.processes,
        "gpus": args.gpus,
        "max_restarts": args.max_restarts,
        "heal": args.heal,
        "cluster": args.cluster,
        "nodes": args.nodes,
        "output": args.output,
        "hang_timeout": args.hang_timeout,
        "rich_output": args.rich_output,
    }


def _quiet(cell: str) -> bool:
    """A cell whose last line ends with ``;`` shows no value (as IPython does)."""
    lines = [line.split("#", 1)[0].rstrip() for line in cell.rstrip().splitlines()]
    lines = [line for line in lines if line]
    return bool(lines) and lines[-1].endswith(";")


def _say(text: str) -> None:
    display({"text/plain": f"distributed: {text}"}, raw=True)


def format_status(pool: Any, rows: list[dict[str, Any]]) -> str:
    """The ``%distributed status`` table: one line per rank."""
    head = f"{pool!r}; restarts so far: {pool.restarts}"
    columns = [
        "rank",
        "pid",
        "host",
        "uptime",
        "memory (RSS)",
        "device",
        "allocated",
        "reserved",
        "device in use",
    ]
    table = [columns]
    for row in rows:
        cuda = "device" in row
        table.append(
            [
                str(row["rank"]),
                str(row["pid"]),
                row["host"],
                _duration(row["uptime_s"]),
                _bytes(row["rss"]),
                row.get("device", "-"),
                _bytes(row["allocated"]) if cuda else "-",
                _bytes(row["reserved"]) if cuda else "-",
                f"{_bytes(row['device_used'])} / {_bytes(row['device_total'])}" if cuda else "-",
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]
    return "\n".join([head, *lines])


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"
