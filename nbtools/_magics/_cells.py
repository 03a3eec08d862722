"""How the magics read a cell: the number IPython shows for it, and a line without its comment."""

from __future__ import annotations

from typing import Any

__all__ = ["cell_number", "strip_comment"]


def cell_number(shell: Any) -> int:
    """The number IPython shows for the running cell (``In[N]``).

    Taken from the running cell's own result, which IPython numbers before the
    cell runs, rather than from ``shell.execution_count``, which front ends and
    IPython versions advance at different moments.
    """
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else int(shell.execution_count)


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment``, as a shell reads it.

    A ``#`` starts a comment where it begins a word (at the start or after
    whitespace) outside quotes; ``a#b`` and ``"# kept"`` stay as they are.
    Unbalanced quotes leave the line whole, for the parser to report.
    """
    quote = ""
    previous = " "
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and previous.isspace():
            return line[:index].rstrip()
        previous = char
    return line.strip() if not quote else line
