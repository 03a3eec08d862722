"""Tracebacks as a notebook user reads them: their own frames, cells named as IPython names them.

IPython shows ``Cell In[3], line 5`` for code of a cell, where Python's own
traceback names the kernel's temporary file (``/tmp/ipykernel_1234/941878922.py``).
A launcher's error should read the same way, and show the frames of the user's
code, not the launcher's. Nothing here imports IPython: the running shell, when
there is one, is found through the module IPython itself already loaded.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

__all__ = ["cell_label", "user_traceback"]

# The nbtools package: frames of files under it are the launcher's, not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def cell_label(filename: str) -> str | None:
    """``'Cell In[3]'`` for the file of a cell of the running IPython shell, else ``None``."""
    ipython = sys.modules.get("IPython")
    get_shell = getattr(ipython, "get_ipython", None)
    shell = get_shell() if callable(get_shell) else None
    compiler = getattr(shell, "compile", None)
    format_name = getattr(compiler, "format_code_name", None)
    if not callable(format_name):
        return None
    try:
        found = format_name(filename)
    except Exception:  # noqa: BLE001 - a shell of another make: fall back to the file name
        return None
    if not found:
        return None
    label, name = found
    return f"{label} {name}"


def _hidden_dirs() -> tuple[str, ...]:
    # nbtools' own frames, and the shell's frame that ran the cell (IPython hides it too).
    dirs = [_PACKAGE_DIR]
    ipython_file = getattr(sys.modules.get("IPython"), "__file__", None)
    if ipython_file:
        dirs.append(os.path.dirname(os.path.abspath(ipython_file)) + os.sep)
    return tuple(dirs)


def user_traceback(exc: BaseException, tb: TracebackType | None = None) -> list[str]:
    """The lines of ``exc``'s traceback without nbtools' frames, ending with ``Type: message``.

    Frames of notebook cells are named as IPython names them. The exception and
    its ``__traceback__`` are left as they are.
    """
    hidden = _hidden_dirs()
    frames = [
        f
        for f in traceback.extract_tb(tb or exc.__traceback__)
        if not os.path.abspath(f.filename).startswith(hidden)
    ]
    lines = []
    if frames:
        lines.append("Traceback (most recent call last):")
        for frame in frames:
            where = cell_label(frame.filename) or f'File "{frame.filename}"'
            lines.append(f"  {where}, line {frame.lineno}, in {frame.name}")
            if frame.line:
                lines.append(f"    {frame.line.strip()}")
    message = str(exc)
    lines.extend(f"{type(exc).__name__}: {message}".splitlines() or [type(exc).__name__])
    return lines
