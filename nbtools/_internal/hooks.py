"""Where an integration with a library takes part in a launch, without the launcher knowing it.

The launcher is core and may not import what sits above it (``nbtools.tracking``
and its ``mlflow``). Instead, the top of the package registers integrations by
*name* (``nbtools/__init__.py``): a library, and the dotted paths of functions
to call at two moments of a launch. Registering imports nothing.

- :func:`before_launch` runs in the launching process (the kernel) before any
  rank starts. An integration's function runs only when the launched code uses
  its library: it is installed and named in the pickled payload (``import
  mlflow`` or ``report_to="mlflow"`` inside the function, a global ``mlflow``
  the function uses, a cell's helper that uses it). Having imported the library
  or configured it in the environment is not enough: a launch that does not use
  it pays one scan of the payload, nothing more.
- :func:`launch_ended` runs in the launching process once a launch has ended for
  good (its ranks returned, failed past ``max_restarts``, or were interrupted),
  with the launch's run id: a core package that keeps per-launch state outside
  the ranks (the checkpoint memory tier's snapshots) registers a function for it
  with :func:`at_launch_end`, by name, as integrations do.
- :func:`rank_started` runs in every rank at its start. An integration's
  function runs once its library is imported in the rank: at once when it
  already is, else right after the rank's code first imports it, so a rank
  whose code never imports the library never imports it either.

:func:`after_import` is that mechanism on its own, for any module and any
function: the one way nbtools changes a library's module right after it first
runs (before a parent package takes names from it), without importing it.

A failing integration is logged and never fails the launch or the user's import.
This module is stdlib only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "Integration",
    "after_import",
    "at_launch_end",
    "before_launch",
    "launch_ended",
    "rank_started",
    "register",
    "registered",
]


@dataclass(frozen=True)
class Integration:
    """A library and what to call for it; functions are ``"package.module:function"``.

    Attributes:
        library: Top-level module name of the library, e.g. ``"mlflow"``.
        before_launch: Called without arguments in the launching process.
        in_rank: Called without arguments in each rank once the library is imported there.
    """

    library: str
    before_launch: str | None = None
    in_rank: str | None = None


_REGISTRY: dict[str, Integration] = {}
_AT_END: list[str] = []
_LOCK = threading.Lock()


def register(library: str, *, before_launch: str | None = None, in_rank: str | None = None) -> None:
    """Register (or replace) the integration for ``library``. Imports nothing."""
    for target in (before_launch, in_rank):
        if target is not None and (not isinstance(target, str) or target.count(":") != 1):
            raise ValueError(
                f"an integration names its function as 'module:function', got {target!r}"
            )
    with _LOCK:
        _REGISTRY[library] = Integration(library, before_launch, in_rank)


def at_launch_end(target: str) -> None:
    """Call ``target`` (``"package.module:function"``) with the run id of every launch that
    ends for good in this process. Imports nothing; registering twice calls it once."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(
            f"a launch-end hook names its function as 'module:function', got {target!r}"
        )
    with _LOCK:
        if target not in _AT_END:
            _AT_END.append(target)


def launch_ended(run_id: str, *, imported_only: bool = False) -> None:
    """After a launch ended for good: run every launch-end hook (in the launching process,
    or on one of the launch's other nodes).

    ``imported_only``: only the hooks whose module this process has imported, for a
    process that ran the launch's code itself (a rank): a package its code never
    imported kept nothing of the launch there.
    """
    with _LOCK:
        targets = list(_AT_END)
    for target in targets:
        if imported_only and target.partition(":")[0] not in sys.modules:
            continue
        _call(target, "after the launch ended", run_id)


def registered() -> list[Integration]:
    """The integrations registered in this process."""
    with _LOCK:
        return list(_REGISTRY.values())


def _call(target: str, moment: str, *args: Any) -> None:
    module_name, _, function = target.partition(":")
    try:
        getattr(importlib.import_module(module_name), function)(*args)
    except Exception as exc:  # noqa: BLE001 - an integration never breaks a launch or an import
        from nbtools._internal.log import get_logger

        get_logger("launch").warning(
            "%s (%s) failed and was skipped: %s: %s", target, moment, type(exc).__name__, exc
        )


def _in_use(integration: Integration, payload: bytes) -> bool:
    library = integration.library
    return library.encode() in payload and importlib.util.find_spec(library) is not None


def before_launch(payload: bytes = b"") -> None:
    """In the launching process, before ranks start: run the hooks of the libraries in use."""
    for integration in registered():
        if integration.before_launch and _in_use(integration, payload):
            _call(integration.before_launch, "before the ranks start")


def rank_started() -> None:
    """In a rank, at its start: run each in-rank hook now or once its library is imported."""
    for integration in registered():
        if not integration.in_rank:
            continue
        if integration.library in sys.modules:
            _call(integration.in_rank, "in the rank")
        else:
            _ImportWatch.add(integration.library, integration.in_rank)


def after_import(module: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` once ``module`` (a dotted name) has first run in this process.

    At once when it is already imported; else right after its code ran, before
    the import statement that loaded it returns (so a parent package that takes
    a name from it, ``from .x import f``, takes what ``fn`` left there). Nothing
    is imported for this. A failing ``fn`` is logged and never fails the import.
    The same ``fn`` registered twice for one module runs once.
    """
    loaded = sys.modules.get(module)
    if loaded is not None:
        _run(fn, loaded)
    else:
        _ImportWatch.add(module, fn)


def _run(fn: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        fn(module)
    except Exception as exc:  # noqa: BLE001 - a hook never breaks the user's import
        from nbtools._internal.log import get_logger

        name = getattr(fn, "__qualname__", repr(fn))
        get_logger("launch").warning(
            "%s (after %s was imported) failed and was skipped: %s: %s",
            name,
            module.__name__,
            type(exc).__name__,
            exc,
        )


class _Loader(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then calls what waited for the module."""

    def __init__(self, loader: Any, after: Any) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
        self._after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _ImportWatch(importlib.abc.MetaPathFinder):
    """One finder at the front of ``sys.meta_path`` that notices first imports of watched libraries."""

    _instance: _ImportWatch | None = None

    def __init__(self) -> None:
        # What waits for each module: "module:function" targets, or functions of the module.
        self._waiting: dict[str, list[str | Callable[[ModuleType], None]]] = {}
        self._finding: set[str] = set()

    @classmethod
    def add(cls, library: str, target: str | Callable[[ModuleType], None]) -> None:
        with _LOCK:
            watch = cls._instance
            if watch is None or watch not in sys.meta_path:
                watch = cls._instance = cls()
                sys.meta_path.insert(0, watch)
            targets = watch._waiting.setdefault(library, [])
            if target not in targets:
                targets.append(target)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._waiting or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)  # asks the finders after this one
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self._imported)
        return spec

    def _imported(self, module: ModuleType) -> None:
        library = module.__name__
        with _LOCK:
            targets = self._waiting.pop(library, [])
            if not self._waiting and self in sys.meta_path:
                sys.meta_path.remove(self)
        for target in targets:
            if isinstance(target, str):
                _call(target, f"after the rank imported {library}")
            else:
                _run(target, module)
