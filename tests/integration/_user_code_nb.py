"""A real Jupyter kernel that runs cells one at a time, as a notebook user does.

Users define their datasets, models and helpers in notebook cells, so these
classes live in the kernel's ``__main__`` and reach the ranks by value
(cloudpickle). Running the same code from an importable test module would send
them by reference and hide every failure that only notebooks see; hence a real
kernel started by ``nbclient``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from types import TracebackType

import nbformat
import pytest
from nbclient import NotebookClient

__all__ = ["NotebookKernel", "requires"]

#: Seconds one cell may run: a cell that starts ranks importing a large library
#: on a busy 2-core machine is slow, a hung collective must still end the test.
CELL_TIMEOUT = 240


def requires(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module is installed (checked without importing it)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing),
        reason=f"needs {', '.join(missing)} (pip install -e '.[examples]')",
    )


class NotebookKernel:
    """A python3 kernel whose cells are recorded in a notebook (``self.nb``).

    Use as a context manager; the kernel is shut down on exit.
    """

    def __init__(self, cwd: str | os.PathLike[str], timeout: int = CELL_TIMEOUT) -> None:
        self.nb = nbformat.v4.new_notebook()
        self.nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        self.client = NotebookClient(
            self.nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": os.fspath(cwd)}},
        )
        self._setup = None

    def __enter__(self) -> NotebookKernel:
        self._setup = self.client.setup_kernel()
        self._setup.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        setup, self._setup = self._setup, None
        if setup is not None:
            setup.__exit__(exc_type, exc, tb)

    def run(self, source: str) -> str:
        """Execute one cell; return its text output (streams, then the result).

        A cell that raises fails with nbclient's ``CellExecutionError``, which
        carries the cell and its traceback (including remote rank tracebacks).
        """
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return cell_text(cell)

    def eval(self, expression: str) -> object:
        """Execute ``expression`` as a cell and return its value (a Python literal)."""
        cell = nbformat.v4.new_code_cell(expression)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        for output in cell.outputs:
            if output.output_type == "execute_result":
                return ast.literal_eval(output.data["text/plain"])
        raise AssertionError(f"{expression!r} gave no value; output:\n{cell_text(cell)}")


def cell_text(cell: nbformat.NotebookNode) -> str:
    """The text a user sees under a cell: streams, results and errors in order."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", "") + "\n")
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback) + "\n")
    return "".join(parts)
