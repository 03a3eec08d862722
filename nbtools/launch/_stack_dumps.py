"""A rank's stack dump folded to the user's frames before it reaches the cell.

A rank prints every thread's stack (``faulthandler``) when the kernel is
interrupted or a hang is reported. Most of it is not the user's: nbtools' own
threads (events, retention, leases, the caller watch) and the frames of
torch, libraries and the standard library. The cell gets, per rank, the
threads that run user code with only their user frames, and one line that
counts the rest (a thread's innermost frame is kept: the call the user's code
waits in, such as ``all_reduce``); the whole dump is kept (:attr:`StackFolder.full`) for
``exc.stacks``.

User code is code sent by value from the notebook (``<dynamic-code>``, named
``Cell In[K], line L`` later) and files outside nbtools, the standard library
and installed packages.
"""

from __future__ import annotations

import os
import re
import sysconfig

__all__ = ["StackFolder"]

_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(.*)", line \d+ in .*$')
_NBTOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _library_roots() -> tuple[str, ...]:
    roots = {_NBTOOLS}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(roots))


_LIBRARIES = _library_roots()


def _is_user(frame_line: str) -> bool:
    match = _FRAME.match(frame_line)
    if match is None:
        return False
    path = match.group(1)
    if path == "<dynamic-code>":
        return True
    if path.startswith("<"):
        return False  # frozen modules and the like
    return not os.path.abspath(path).startswith(_LIBRARIES) and "site-packages" not in path


class StackFolder:
    """Folds one rank's stack dumps line by line (see the module docstring)."""

    def __init__(self) -> None:
        self.full: list[str] = []
        self._threads: list[tuple[str, list[str]]] = []

    def feed(self, line: str) -> tuple[list[str], bool]:
        """Take one line; what to show now, and whether the line was part of a dump."""
        if _THREAD.match(line):
            self.full.append(line)
            self._threads.append((line, []))
            return [], True
        if not self._threads:
            return [], False
        if _FRAME.match(line) or line.strip() in ("", "<no Python frame>"):
            self.full.append(line)
            if line.strip():
                self._threads[-1][1].append(line)
            return [], True
        return self.flush(), False

    def flush(self) -> list[str]:
        """The folded form of the dump read so far (nothing when none is pending)."""
        if not self._threads:
            return []
        out: list[str] = []
        hidden = 0
        for header, frames in self._threads:
            user = [frame for frame in frames if _is_user(frame)]
            if not user:
                hidden += 1
                continue
            if not _is_user(frames[0]):
                user.insert(0, frames[0])  # the call the user's code waits in (all_reduce)
            out.append(header)
            out.extend(user)
            if len(user) < len(frames):
                out.append(f"  (+{len(frames) - len(user)} frames of nbtools and libraries)")
        if hidden:
            out.append(
                f"+{hidden} thread{'s' if hidden != 1 else ''} of nbtools and libraries "
                "(the whole dump: the exception's .stacks)"
            )
        self._threads = []
        return out
