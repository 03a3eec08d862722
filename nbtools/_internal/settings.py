"""Every ``NBTOOLS_*`` environment variable nbtools reads, in one table.

:data:`SETTINGS` names each variable once: its type, its default, what it changes, and
whether a user sets it or nbtools sets it for its ranks. The documentation's configuration
reference is generated from this table, and a test checks that every ``NBTOOLS_`` name in the
package's source is listed here. :func:`read` returns a variable's value parsed and checked,
with an error that names the variable and says what it accepts; :func:`problems` lists what is
wrong with an environment's ``NBTOOLS_*`` variables (``nbtools doctor`` shows it).

Example:
    >>> from nbtools._internal import settings
    >>> settings.read("NBTOOLS_STRAGGLER_WINDOW_S", {"NBTOOLS_STRAGGLER_WINDOW_S": "20"})
    20.0
    >>> list(settings.problems({"NBTOOLS_STAGING": "/scratch"}))  # no such variable
    ['NBTOOLS_STAGING']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Setting", "SETTINGS", "by_name", "problems", "read"]


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One environment variable: what it is called, holds, defaults to and changes.

    Attributes:
        name: The variable's name, ``NBTOOLS_...``.
        type: What the value is, as the documentation says it (``path``, ``int``, ...).
        default: The default as the documentation says it (``""`` when it is unset).
        meaning: What it changes, one or two sentences of Markdown.
        area: The part of nbtools that reads it (``checkpoint``, ``data``, ...).
        internal: Set by nbtools in the ranks it starts; a user never sets it.
        parse: Turns the text of the variable into its value; raises ``ValueError`` when
            the text is not one.
    """

    name: str
    type: str
    default: str
    meaning: str
    area: str
    internal: bool = False
    parse: Callable[[str], Any] = str


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("must be a whole number") from None


def _bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("must be a whole number of bytes, e.g. 10000000000") from None
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


def _positive(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise ValueError("must be more than 0")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value < 1:
        raise ValueError("must be between 0 and 1")
    return value


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return text == "1"


def _level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="NBTOOLS_STAGING_DIR",
        type="path",
        default="the system temp directory",
        meaning="Local directory where checkpoint saves and volume reads stage their shards. "
        "Point it at a large local disk when the temp directory is small; "
        "`CheckpointManager(staging_dir=...)` overrides it for one manager.",
        area="checkpoint",
    ),
    Setting(
        name="NBTOOLS_SNAPSHOT_DIR",
        type="path",
        default="`/dev/shm`",
        meaning="Shared-memory filesystem that holds the memory tier's snapshots "
        "(`memory_every=`). Use a larger tmpfs when `/dev/shm` is too small for the "
        "state of every rank on the node. `nbtools doctor` checks its size and free space.",
        area="checkpoint",
    ),
    Setting(
        name="NBTOOLS_CACHE_DIR",
        type="path",
        default="`$XDG_CACHE_HOME/nbtools`, else `~/.cache/nbtools`",
        meaning="Private cache (mode 0700) of `VolumeDataset`'s local copies, shared by every "
        "worker and rank of the node. `VolumeDataset(cache_dir=...)` overrides it.",
        area="data",
    ),
    Setting(
        name="NBTOOLS_CACHE_MIN_FREE_BYTES",
        type="int (bytes)",
        default="10 % of the cache's filesystem",
        meaning="Free space the dataset cache keeps on its filesystem; the least recently "
        "used copies are evicted to keep it. `SGC_FSLAYER_MIN_FREE_DISK_BYTES` is read when "
        "this is unset; `VolumeDataset(min_free_bytes=...)` overrides both.",
        area="data",
        parse=_bytes,
    ),
    Setting(
        name="NBTOOLS_LOG_LEVEL",
        type="level name",
        default="`WARNING`",
        meaning="Level of the `nbtools` logger (`DEBUG`, `INFO`, `WARNING`, `ERROR`).",
        area="logging",
        parse=_level,
    ),
    Setting(
        name="NBTOOLS_LOG_ALL_RANKS",
        type="`0` or `1`",
        default="`0`",
        meaning="`1` keeps nbtools' log records of every rank; by default only rank 0's are kept.",
        area="logging",
        parse=_flag,
    ),
    Setting(
        name="NBTOOLS_STRAGGLER_THRESHOLD",
        type="float in (0, 1)",
        default="`0.75`",
        meaning="A rank whose share of time outside collectives falls under this fraction of "
        "the median rank's is flagged as a straggler.",
        area="events",
        parse=_fraction,
    ),
    Setting(
        name="NBTOOLS_STRAGGLER_WINDOW_S",
        type="seconds",
        default="`30`",
        meaning="Length of the window over which each rank's progress is scored.",
        area="events",
        parse=_positive,
    ),
    Setting(
        name="NBTOOLS_STRAGGLER_CONFIRM_S",
        type="seconds",
        default="`10`",
        meaning="How long a rank must stay under the threshold before a `straggler` event is emitted.",
        area="events",
        parse=_positive,
    ),
    Setting(
        name="NBTOOLS_STARTUP_TIMEOUT_S",
        type="seconds",
        default="learned: 3x the slowest first step, 180 before one",
        meaning="Seconds a rank has, from its launch, to report its first step before it "
        "can be named as hung (imports, a restore, a cold compile).",
        area="events",
        parse=_positive,
    ),
    Setting(
        name="NBTOOLS_RAY_PLACEMENT_TIMEOUT",
        type="seconds",
        default="`120`",
        meaning='How long `cluster="ray"` waits for the Ray cluster to have the ranks\' '
        "resources free before it fails with a `LaunchError`.",
        area="launch",
        parse=_positive,
    ),
    Setting(
        name="NBTOOLS_POOL_SHARED_MEMORY",
        type="`0` or `1`",
        default="`1`",
        meaning="`0` sends a `RankPool`'s large tensors and arrays through its sockets instead "
        "of shared memory (for `/proc` mounted with `hidepid` or ptrace restrictions).",
        area="launch",
        parse=_flag,
    ),
    Setting(
        name="NBTOOLS_EVENTS_CHANNEL",
        type="text",
        default="unset",
        meaning="Where a rank sends its training events (steps, checkpoints, data waits) for "
        "the kernel's GPU pane and watchdog.",
        area="events",
        internal=True,
    ),
    Setting(
        name="NBTOOLS_NODE",
        type="text",
        default="the host name",
        meaning="The node name a rank's events and the GPU pane use for its host.",
        area="events",
        internal=True,
    ),
    Setting(
        name="NBTOOLS_NODE_ID",
        type="int",
        default="unset",
        meaning="Index of a Ray rank's node among the nodes of its launch.",
        area="launch",
        internal=True,
        parse=_whole,
    ),
    Setting(
        name="NBTOOLS_HEAL_GENERATION",
        type="int",
        default="unset",
        meaning="The generation of a group that heals in place: 0 as started, one more after "
        "each heal.",
        area="launch",
        internal=True,
        parse=_whole,
    ),
    Setting(
        name="NBTOOLS_HEAL_REPLACED",
        type="text",
        default="unset",
        meaning="The ranks the last heal replaced, comma-separated (empty before any heal).",
        area="launch",
        internal=True,
    ),
    Setting(
        name="NBTOOLS_HEAL_DIR",
        type="path",
        default="unset",
        meaning="The launch's directory where each rank of a group that heals keeps its latest "
        "per-rank state (RNG, loader position) for its replacement.",
        area="launch",
        internal=True,
    ),
    Setting(
        name="NBTOOLS_HEAL_TARGET",
        type="int",
        default="unset",
        meaning="The world size a group that heals in place was started with: a group that "
        "shrank (`min_processes`) grows back to it.",
        area="launch",
        internal=True,
        parse=_whole,
    ),
    Setting(
        name="NBTOOLS_RESULTS_DEVICE",
        type="`cpu` or `cuda`",
        default="cpu",
        meaning="Where CUDA tensors in a rank's return value arrive: copied to host memory in "
        "the rank (`cpu`), or kept on the GPU (`cuda`); `@distributed(results_device=...)`.",
        area="launch",
        internal=True,
    ),
    Setting(
        name="NBTOOLS_KERNEL_LOGGING",
        type="JSON",
        default="unset",
        meaning="The kernel's root logger (level, each handler's format), applied in every rank.",
        area="launch",
        internal=True,
    ),
    Setting(
        name="NBTOOLS_RICH_OUTPUT",
        type="JSON",
        default="unset",
        meaning="Where rank 0 (or every rank) hands `display()` and matplotlib output to the "
        "kernel, so that it reaches the cell as rich output.",
        area="launch",
        internal=True,
    ),
)

_BY_NAME: Mapping[str, Setting] = {setting.name: setting for setting in SETTINGS}


def by_name(name: str) -> Setting:
    """The :class:`Setting` called ``name``.

    Raises:
        KeyError: no setting has that name; the message lists the names there are.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not an nbtools setting; known: {', '.join(_BY_NAME)}") from None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` in ``environ`` (default ``os.environ``), parsed; None when unset.

    Raises:
        ValueError: the variable is set to a value its type does not accept; the message
            names the variable, the value and what it takes.
    """
    setting = by_name(name)
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return None
    try:
        return setting.parse(text)
    except ValueError as error:
        raise ValueError(
            f"{name}={text!r} is not a valid {setting.type.replace('`', '')}: {error}; unset "
            f"it for the default ({setting.default.replace('`', '')})"
        ) from None


def problems(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What is wrong with the ``NBTOOLS_*`` variables of ``environ`` (default ``os.environ``).

    Maps each variable a user sets whose value its type does not accept, and each ``NBTOOLS_``
    name that nbtools does not read (a misspelt or retired name), to a message that names it;
    empty when all is well. The variables nbtools sets in its own ranks are not checked.
    """
    environ = os.environ if environ is None else environ
    found = {}
    for name in sorted(n for n in environ if n.startswith("NBTOOLS_")):
        setting = _BY_NAME.get(name)
        if setting is None:
            found[name] = f"{name} is set but nbtools reads no such variable (a misspelt name?)"
        elif not setting.internal:
            try:
                read(name, environ)
            except ValueError as error:
                found[name] = str(error)
    return found
