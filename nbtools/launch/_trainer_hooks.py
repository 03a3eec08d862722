"""Step reports from HF ``Trainer`` and Lightning ``Trainer``, with no code in the user's loop.

:func:`install`, run once in a rank before the user's function, registers a
post-import hook: when ``transformers.trainer`` or Lightning's trainer module
is imported (or right away, if it already is), its ``Trainer`` gets a
callback that calls :func:`nbtools.events.step` after each optimizer step,
through the library's own callback interface. Nothing is imported that the
user's code does not import itself: a rank that never uses these libraries
pays for one dictionary lookup per import.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nbtools import events
from nbtools._internal.log import get_logger

__all__ = ["install"]

_log = get_logger("launch")
_MARK = "_nbtools_reports_steps"


def _patch_hf(module: ModuleType) -> None:
    from transformers.trainer_callback import TrainerCallback

    class _StepReports(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            events.step(int(state.global_step))

    def add(trainer: Any) -> None:
        if not any(isinstance(cb, _StepReports) for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(_StepReports())

    _wrap_init(module.Trainer, add)


def _patch_lightning(module: ModuleType) -> None:
    package = module.__name__.split(".trainer", 1)[0]  # lightning.pytorch or pytorch_lightning
    callback_base = sys.modules.get(f"{package}.callbacks.callback")
    if callback_base is None:
        callback_base = __import__(f"{package}.callbacks.callback", fromlist=["Callback"])

    class _StepReports(callback_base.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            events.step(int(trainer.global_step))

    def add(trainer: Any) -> None:
        if not any(isinstance(cb, _StepReports) for cb in trainer.callbacks):
            trainer.callbacks.append(_StepReports())

    _wrap_init(module.Trainer, add)


def _wrap_init(cls: type, after: Callable[[Any], None]) -> None:
    if getattr(cls, _MARK, False):
        return
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            after(self)
        except Exception:  # noqa: BLE001 - progress reports must never break training
            _log.debug("could not add step reports to %s", type(self).__name__, exc_info=True)

    cls.__init__ = __init__  # type: ignore[misc]
    setattr(cls, _MARK, True)


_TARGETS: dict[str, Callable[[ModuleType], None]] = {
    "transformers.trainer": _patch_hf,
    "lightning.pytorch.trainer.trainer": _patch_lightning,
    "pytorch_lightning.trainer.trainer": _patch_lightning,
}


class _Loader(importlib.abc.Loader):
    """The library's own loader, then the patch; everything else is the library's loader's."""

    def __init__(self, inner: Any, patch: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _apply(self._patch, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _TARGETS.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def _apply(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        patch(module)
    except Exception:  # noqa: BLE001 - a library version we do not know: no reports, no harm
        _log.debug("step reports not added to %s", module.__name__, exc_info=True)


def install() -> None:
    """Have HF and Lightning trainers in this process report their steps (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, patch in _TARGETS.items():
        module = sys.modules.get(name)
        if module is not None:
            _apply(patch, module)
