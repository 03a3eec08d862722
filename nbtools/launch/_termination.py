"""A launch ended by SIGTERM or SIGHUP ends like an interrupted one, then as the signal asked.

A scheduler (Slurm, ``timeout``, a container runtime) or a closed terminal ends
the launching process with SIGTERM or SIGHUP. By default that ends it at once:
its ``finally`` blocks never run, and its ranks, the launch's memory snapshots
and its run directory would be left to the forkserver's own end
(:mod:`nbtools.launch._local._forkserver`). During a launch, :func:`ends_launch`
turns either signal into :class:`Terminated` in the main thread: the launch
stops its ranks and cleans up on the way out, as on Ctrl+C (without the stack
dump), and the process then ends by the same signal, as it would have.

Only a signal whose handler is the default one is taken over: a handler the
program installed itself keeps deciding what the signal means.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "ends_launch"]

_SIGNALS = ("SIGTERM", "SIGHUP")


class Terminated(BaseException):
    """The launching process got SIGTERM or SIGHUP during a launch (raised in its main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"the launching process got {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def ends_launch() -> Iterator[None]:
    """During the block: SIGTERM and SIGHUP raise :class:`Terminated`; after the block has
    cleaned up, the process ends by that signal. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if got:
            return  # already ending: let the clean-up finish
        got.append(signum)
        raise Terminated(signum)

    saved: dict[int, object] = {}
    for name in _SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            saved[signum] = signal.signal(signum, handler)
    try:
        yield
    except Terminated:
        pass
    finally:
        for signum in saved:
            signal.signal(signum, signal.SIG_DFL)
    if got:
        os.kill(os.getpid(), got[0])  # the default action now: this process ends
