"""What a rank's own code asked to run at interpreter exit, run when the rank ends.

A rank is a ``multiprocessing`` child: it ends with ``os._exit``, never through
interpreter exit, so the ``atexit`` handlers and ``weakref.finalize`` cleanups
that the rank's code and its libraries registered would never run. Under
``torchrun`` a worker is a whole interpreter and they do: W&B ends its
``wandb-core`` service and removes its temporary directories there, a
``tempfile.TemporaryDirectory`` kept for the process's life goes away.

:func:`watch` runs at the rank's start and notes what it inherited from the
process it was forked from (those cleanups belong to that process, and running
them here could remove what it still uses); :func:`run` runs, once the rank's
function returned, what was registered since, in the interpreter's order: the
``atexit`` handlers last registered first, then the finalizers, newest first.
As in the interpreter, a handler unregistered by one that ran before it does
not run, and none runs twice. A failing handler is reported as the interpreter
reports it and the others still run.
"""

from __future__ import annotations

import atexit
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["watch", "run"]

_handlers: list[tuple[Callable[..., Any], tuple, dict]] = []
_inherited: set[Any] | None = None


def watch() -> None:
    """In a rank, before user code: note what registers for interpreter exit from now on."""
    global _inherited
    if _inherited is not None:
        return
    _inherited = set(_registry())
    register, unregister = atexit.register, atexit.unregister

    def register_and_note(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        _handlers.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    def unregister_and_forget(func: Callable[..., Any]) -> None:
        _handlers[:] = [h for h in _handlers if h[0] != func]
        unregister(func)

    register_and_note.__doc__ = register.__doc__
    unregister_and_forget.__doc__ = unregister.__doc__
    atexit.register = register_and_note  # type: ignore[assignment]
    atexit.unregister = unregister_and_forget  # type: ignore[assignment]


def run() -> None:
    """In a rank whose function returned: run what its code registered for interpreter exit."""
    if _inherited is None:
        return
    # One at a time from the live list, as the interpreter does: a handler that an earlier
    # one unregistered (OpenTelemetry's providers, shut down by W&B's own handler) does
    # not run, and none runs twice.
    while _handlers:
        func, args, kwargs = _handlers.pop()
        try:
            func(*args, **kwargs)
        except SystemExit:
            pass
        except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
            print(f"Exception ignored in atexit callback {func!r}:", file=sys.stderr)
            traceback.print_exc()
    registry = _registry()
    pending = sorted(
        (
            (info.index, f)
            for f, info in list(registry.items())
            if f not in _inherited and info.atexit
        ),
        key=lambda item: item[0],
        reverse=True,
    )
    for _, finalizer in pending:
        if not finalizer.alive:
            continue  # called already, by a handler or an earlier finalizer
        try:
            finalizer()
        except BaseException:  # noqa: BLE001 - as above
            print(f"Exception ignored in finalizer {finalizer!r}:", file=sys.stderr)
            traceback.print_exc()


def _registry() -> dict[Any, Any]:
    # weakref.finalize keeps its live finalizers here; the interpreter's exit walks the same.
    return getattr(weakref.finalize, "_registry", {})
