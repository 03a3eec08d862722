"""Retention: deleting old checkpoints in a background worker fed through a queue.

Only ever called on one rank. The newest complete checkpoint is never deleted,
nor an incomplete one newer than it (a save may still be writing it), nor the
step the manager is saving now. A checkpoint is deleted ``.metadata`` first, so
a deletion interrupted half way leaves a directory that discovery ignores, never
a checkpoint that looks complete but is not. Symbolic links named like steps are
never listed, so nothing outside the root is ever deleted through them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection

from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage import METADATA_NAME, Target, step_dir_name
from nbtools.checkpoint.discovery import is_foreign, list_steps

__all__ = ["purge", "RetentionWorker"]

_log = get_logger("checkpoint")


def purge(target: Target, keep: int, protect: Collection[int] = ()) -> list[int]:
    """Delete complete checkpoints beyond the newest ``keep`` and partial ones older than the newest.

    Args:
        target: The checkpoint root.
        keep: Complete checkpoints to keep.
        protect: Steps never deleted (saves in progress).

    Returns:
        The steps deleted.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    steps = list_steps(target)
    complete = [s for s, ok in steps if ok]
    if not complete:
        return []
    newest = complete[0]
    doomed = complete[keep:] + [s for s, ok in steps if not ok and s < newest]
    deleted = []
    for step in sorted(set(doomed) - set(protect)):
        name = step_dir_name(step)
        if is_foreign(target, name):  # replaced by a link since it was listed
            continue
        target.remove_file(f"{name}/{METADATA_NAME}")
        target.remove_tree(name)
        deleted.append(step)
        _log.info("deleted old checkpoint %s", name)
    return deleted


class RetentionWorker:
    """A daemon thread that runs :func:`purge` for each request put on its queue.

    ``protect`` is called before each purge for the steps being saved right now.
    """

    def __init__(self, target: Target, keep: int, protect: Callable[[], Collection[int]]) -> None:
        self._target = target
        self._keep = keep
        self._protect = protect
        self._queue: queue.Queue[bool] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.errors: list[BaseException] = []

    def request(self) -> None:
        """Ask for a purge; returns at once (ignored once closed)."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="nbtools-ckpt-retention", daemon=True
                )
                self._thread.start()
            self._queue.put(True)

    def _run(self) -> None:
        while self._queue.get():
            try:
                purge(self._target, self._keep, self._protect())
            except Exception as exc:  # noqa: BLE001 - retention must never stop training
                _log.warning("could not delete old checkpoints under %s: %s", self._target.url, exc)
                self.errors.append(exc)

    def close(self) -> None:
        """Finish pending purges and stop the thread."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(False)
        if thread is not None:
            thread.join()
