"""The body of ``%%autoresume``: restore, run the cell, finish the last save.

Order matters and is the contract: the cell is compiled and its arguments checked
before anything is restored (a typo costs nothing); objects are restored before
the body runs; whatever ends the body (return, exception, KeyboardInterrupt), the
save in flight is completed before the cell returns, so the newest checkpoint on
disk is always complete. After a normal end the manager's own final save on
``close`` saves the last step reached (once). Reports go to the cell's output
through IPython's display, not to stdout.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.display import display

from nbtools._internal.location import local_path, unwritable_reason
from nbtools._magics._cells import cell_number
from nbtools.errors import CheckpointError

__all__ = ["AutoresumeOptions", "run_autoresume"]

# Names the magic puts into the user namespace; never treated as state to save.
_INJECTED = ("start_step", "checkpoint", "mlflow_logger")


@dataclass(kw_only=True)
class AutoresumeOptions:
    """Parsed arguments of ``%%autoresume``."""

    root: str
    every: int | None = None
    keep: int | None = None
    memory_every: int | None = None
    replicas: int | None = None
    state: str | None = None
    mlflow: bool = False
    run_name: str | None = None


def _say(text: str) -> None:
    """Show one line of report in the cell's output."""
    display({"text/plain": f"autoresume: {text}"}, raw=True)


def _is_stateful(value: Any) -> bool:
    if isinstance(value, type) or inspect.ismodule(value) or inspect.isroutine(value):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _state_objects(namespace: dict[str, Any], spec: str | None) -> dict[str, Any]:
    """The objects to checkpoint: those named in ``--state``, else every stateful object."""
    if spec is None:
        objects = {
            name: value
            for name, value in namespace.items()
            if not name.startswith("_") and name not in _INJECTED and _is_stateful(value)
        }
        for name, value in list(objects.items()):
            unsaved = _no_position(value)
            if unsaved is not None:
                del objects[name]
                _say(
                    f"leaving out {name} (a DataLoader over a {unsaved}, which has no position "
                    "to save): its epoch starts over on each run; --state names what to save"
                )
        return objects
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise UsageError("autoresume: --state is empty; list names such as --state model,optimizer")
    objects = {}
    for name in names:
        if not name.isidentifier():
            raise UsageError(f"autoresume: --state entry {name!r} is not a Python name")
        if name not in namespace:
            raise UsageError(
                f"autoresume: no object named {name!r} in the notebook; define it in an "
                "earlier cell or remove it from --state"
            )
        if not _is_stateful(namespace[name]):
            raise UsageError(
                f"autoresume: {name!r} ({type(namespace[name]).__name__}) has no "
                "state_dict()/load_state_dict(); checkpoint models, optimizers, schedulers, "
                "datasets or loaders"
            )
        unsaved = _no_position(namespace[name])
        if unsaved is not None:
            raise UsageError(
                f"autoresume: {name!r} is a DataLoader over a {unsaved}, which has no position "
                f"to save; remove {name!r} from --state (each run of the cell then starts the "
                "loader's epoch over), or load files through a VolumeDataset, or give the "
                f"{unsaved} state_dict()/load_state_dict()"
            )
        objects[name] = namespace[name]
    return objects


def _no_position(value: Any) -> str | None:
    """The dataset's type name when ``value`` is nbtools' DataLoader that cannot save a position.

    Its ``state_dict`` would fail at the first save, after the cell has run for a
    while; checked before anything runs instead. Other objects: None.
    """
    from nbtools.data import DataLoader

    if not isinstance(value, DataLoader) or value.saves_position:
        return None
    return type(value.dataset).__name__


def _writable_root(root: str) -> str:
    """Create ROOT if needed and check that it can be written; URLs are left to fsspec."""
    path = local_path(root)
    if path is None:
        return root
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"autoresume: cannot create ROOT {path} ({exc.strerror or exc}); "
            "choose a directory you can write to"
        ) from None
    reason = unwritable_reason(path)
    if reason is not None:
        raise UsageError(
            f"autoresume: ROOT {path} is not writable ({reason}); "
            "choose a directory you can write to"
        )
    return path


def _compile_body(shell: Any, cell: str) -> tuple[Any, Any]:
    """Compile the cell body like IPython does, so tracebacks point at the cell's lines.

    Returns the statements and, when the body ends with an expression, that
    expression separately, so its value becomes the cell's output.
    """
    # The blank first line stands for the magic's own line: line numbers match the cell.
    source = "\n" + shell.transform_cell(cell)
    tree = shell.transform_ast(shell.compile.ast_parse(source))
    filename = shell.compile.cache(source, cell_number(shell), raw_code="\n" + cell)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = shell.compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return shell.compile(tree, filename, "exec"), last


class _Checkpointer:
    """The ``checkpoint(step)`` function given to the cell body."""

    def __init__(self, manager: Any, objects: dict[str, Any]) -> None:
        self._manager = manager
        self._objects = objects
        self.finished = False

    def __call__(self, step: int) -> None:
        """Save the cell's state at ``step`` when due, in the background.

        Raises:
            CheckpointError: The ``%%autoresume`` cell it belongs to has ended.
        """
        if self.finished:
            raise CheckpointError(
                "checkpoint() belongs to an %%autoresume cell that has finished; "
                "run that cell again to continue"
            )
        self._manager.maybe_save(step, **self._objects)

    def __repr__(self) -> str:
        names = ", ".join(self._objects) or "step only"
        return f"<checkpoint(step): saves {names} when due>"


def _describe(objects: dict[str, Any]) -> str:
    return ", ".join(objects) if objects else "no objects (step only)"


def _restore(manager: Any, objects: dict[str, Any], root: str) -> int:
    start = manager.restore(**objects)
    step = manager.restored_step
    for url, reason in manager.skipped:
        _say(f"skipped {url}: {reason}")
    if step is None:
        _say(
            f"no checkpoint under {root}; starting fresh with start_step = 0 "
            f"(state: {_describe(objects)})"
        )
        return start
    run = f", MLflow run {manager.mlflow_run_id}" if manager.mlflow_run_id else ""
    _say(f"restored step {step} from {root} into {_describe(objects)}{run}; start_step = {start}")
    return start


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[list[bool]]:
    """Hold back one KeyboardInterrupt while a checkpoint is completed; a second one is obeyed.

    Yields a list that holds True once an interrupt was held back. Only the main
    thread can handle signals; elsewhere interrupts are not deferred.
    """
    deferred: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return
    previous = signal.getsignal(signal.SIGINT)

    def _hold(signum: int, frame: Any) -> None:
        deferred.append(True)
        _say("finishing the checkpoint being written; interrupt again to abandon it")
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, _hold)
    try:
        yield deferred
    finally:
        signal.signal(signal.SIGINT, previous)


def _finish(manager: Any, checkpointer: _Checkpointer, completed: bool) -> None:
    """Complete the save in flight; after a normal end also save the last step reached.

    The manager's ``close`` does both: its final save is the last step given
    to ``checkpoint``, when newer than the last checkpoint (the body returned
    normally, so its state is the state after that step).

    Raises:
        KeyboardInterrupt: An interrupt was held back meanwhile (the cell stays interrupted).
    """
    checkpointer.finished = True
    with _interrupts_deferred() as deferred:
        manager.close(final_save=completed)
    if deferred and completed:
        raise KeyboardInterrupt


def _report(manager: Any, root: str, finished: bool) -> None:
    saved = manager.last_saved_step
    if saved is None:
        saved = manager.restored_step
    if saved is None:
        _say(f"nothing saved under {root} (checkpoint(step) saves when a step is due)")
    elif finished:
        _say(f"the cell finished; last saved step {saved} under {root}")
    else:
        _say(f"last saved step {saved} under {root}; run the cell again to continue")


def run_autoresume(shell: Any, options: AutoresumeOptions, cell: str) -> Any:
    """Run one ``%%autoresume`` cell; returns the value of the body's last expression."""
    __tracebackhide__ = True  # IPython shows the user's cell, not this frame
    if not cell.strip():
        raise UsageError(
            "autoresume: the cell has no body; put the training loop below the magic line"
        )
    code, last = _compile_body(shell, cell)
    namespace = shell.user_ns
    objects = _state_objects(namespace, options.state)
    root = _writable_root(options.root)

    from nbtools.checkpoint import CheckpointManager

    try:
        manager = CheckpointManager(
            root,
            every=options.every,
            keep=options.keep,
            memory_every=options.memory_every,
            replicas=options.replicas,
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(f"autoresume: {exc}") from None
    logger = None
    try:
        try:
            start = _restore(manager, objects, root)
        except (TypeError, ValueError) as exc:  # objects the checkpoint cannot hold
            raise UsageError(f"autoresume: {exc}") from None
        if options.mlflow:
            logger = _start_logger(manager, options.run_name)
    except BaseException:
        manager.close()
        raise
    checkpointer = _Checkpointer(manager, objects)
    namespace["start_step"] = start
    namespace["checkpoint"] = checkpointer
    if logger is not None:
        namespace["mlflow_logger"] = logger
    status = "FAILED"
    try:
        exec(code, namespace)
        result = eval(last, namespace) if last is not None else None
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        try:
            _finish(manager, checkpointer, completed=status == "FINISHED")
        finally:
            if logger is not None:
                logger.close(status)
            _report(manager, root, finished=status == "FINISHED")
    return result


def _start_logger(manager: Any, run_name: str | None) -> Any:
    from nbtools.errors import TrackingError
    from nbtools.tracking.mlflow import MlflowLogger

    try:
        logger = MlflowLogger(run_id=manager.mlflow_run_id, run_name=run_name)
    except TrackingError as exc:
        raise UsageError(f"autoresume: {exc}") from None
    if manager.mlflow_run_id:
        _say(f"resumed MLflow run {manager.mlflow_run_id} (mlflow_logger)")
    else:  # its id is known once the store is open, which need not hold up the cell
        _say("started an MLflow run (mlflow_logger; its id is mlflow_logger.run_id)")
    return logger
