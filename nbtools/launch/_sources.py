"""Putting the caller's file names and source lines back into a rank's traceback.

cloudpickle sends code by value under the file name ``<dynamic-code>``, so a
rank cannot show where a notebook function lives. The caller still has the
original code objects and (for cells) their source in ``linecache``. Frames of
cells are named as IPython names them (``Cell In[3], line 5``).
"""

from __future__ import annotations

import inspect
import linecache
import re
import types
from collections.abc import Callable, Iterator

from nbtools._internal.tracebacks import cell_label

__all__ = ["localizer"]

# A traceback writes 'line N, in name'; faulthandler's stack dumps 'line N in name'.
_FRAME = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+)(,?) in (\S+)$')
# What ``warnings`` prints for code without a source file: '<dynamic-code>:N: Category: text'.
_WARNING = re.compile(r"^<dynamic-code>:(\d+): (.*)$")


def localizer(fn: Callable) -> Callable[[str], str]:
    """A function that rewrites ``<dynamic-code>`` frames of a traceback or stack dump for ``fn``'s code.

    Warnings that name ``<dynamic-code>`` are rewritten too, with their source line.
    """
    codes: dict[str, list[types.CodeType]] = {}
    for code in _reachable_code(fn):
        codes.setdefault(code.co_name, []).append(code)

    def localize(text: str) -> str:
        out = []
        for line in text.splitlines():
            warned = _WARNING.match(line)
            if warned is not None:
                out.extend(_warning(codes, int(warned.group(1)), warned.group(2)) or [line])
                continue
            match = _FRAME.match(line)
            found = _find(codes, match.group(4), int(match.group(2))) if match else None
            if found is None:
                out.append(line)
                continue
            indent, lineno, comma, name = (
                match.group(1),
                int(match.group(2)),
                match.group(3),
                match.group(4),
            )
            where = cell_label(found.co_filename) or f'File "{found.co_filename}"'
            out.append(f"{indent}{where}, line {lineno}{comma} in {name}")
            source = linecache.getline(found.co_filename, lineno).strip()
            if source:
                out.append(f"{indent}  {source}")
        return "\n".join(out) + ("\n" if text.endswith("\n") else "")

    return localize


def _warning(codes: dict[str, list[types.CodeType]], lineno: int, rest: str) -> list[str]:
    """A warning's first line named as the kernel names it, and its source line; [] if unknown.

    ``warnings`` gives no function name, so the code is the innermost one holding the line.
    """
    holding = [
        code
        for found in codes.values()
        for code in found
        if any(line == lineno for _, _, line in code.co_lines())
    ]
    if not holding:
        return []
    code = min(holding, key=lambda c: max((ln for _, _, ln in c.co_lines() if ln), default=0))
    where = cell_label(code.co_filename) or code.co_filename
    lines = [f"{where}, line {lineno}: {rest}"]
    source = linecache.getline(code.co_filename, lineno).strip()
    if source:
        lines.append(f"  {source}")
    return lines


def _find(codes: dict[str, list[types.CodeType]], name: str, lineno: int) -> types.CodeType | None:
    for code in codes.get(name, ()):
        if any(line == lineno for _, _, line in code.co_lines()):
            return code
    return None


def _reachable_code(fn: Callable) -> Iterator[types.CodeType]:
    """Code of ``fn``, its nested functions, and functions/classes it names from its module."""
    seen: set[int] = set()
    todo: list[object] = [inspect.unwrap(fn)]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or len(seen) > 2000:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            todo.extend(vars(obj).values())
            continue
        code = getattr(obj, "__code__", None)
        if not isinstance(code, types.CodeType):
            continue
        namespace = getattr(obj, "__globals__", {})
        stack = [code]
        while stack:
            current = stack.pop()
            yield current
            stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
            for name in current.co_names:
                value = namespace.get(name)
                if isinstance(value, (types.FunctionType, type)):
                    todo.append(value)
