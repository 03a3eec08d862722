"""Step reports from HF ``Trainer`` and Lightning ``Trainer``, with no code in the user's loop.

:func:`install`, run at every rank's start before the user's function, registers a
post-import hook (:func:`nbtools._internal.hooks.after_import`): when ``transformers.trainer`` or Lightning's trainer module
is imported (or right away, if it already is), its ``Trainer`` gets a
callback that calls :func:`nbtools.events.step` after each optimizer step,
through the library's own callback interface. Nothing is imported that the
user's code does not import itself: a rank that never uses these libraries
pays for one dictionary lookup per import.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nbtools import events
from nbtools._internal import hooks
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


def _apply(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        patch(module)
    except Exception:  # noqa: BLE001 - a library version we do not know: no reports, no harm
        _log.debug("step reports not added to %s", module.__name__, exc_info=True)


def _patch(module: ModuleType) -> None:
    patch = _TARGETS.get(module.__name__)
    if patch is not None:
        _apply(patch, module)


def install() -> None:
    """Have HF and Lightning trainers in this process report their steps (idempotent)."""
    for name in _TARGETS:
        hooks.after_import(name, _patch)
