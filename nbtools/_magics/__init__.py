"""Implementation of the IPython magics registered by ``nbtools.magics``."""

from __future__ import annotations

from typing import Any

__all__: list[str] = ["cell_number"]


def cell_number(shell: Any) -> int:
    """The number IPython shows for the running cell (``In[N]``).

    Taken from the running cell's own result, which IPython numbers before the
    cell runs, rather than from ``shell.execution_count``, which front ends and
    IPython versions advance at different moments.
    """
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else int(shell.execution_count)
