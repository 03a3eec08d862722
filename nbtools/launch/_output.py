"""Live forwarding of every rank's output into the caller's streams, line by line.

torch's elastic machinery redirects each rank's stdout and stderr at the file
descriptor level (so C-level prints are captured too) into log files; one
thread tails all of them and writes complete lines, prefixed ``[rank N] ``,
to the ``sys.stdout``/``sys.stderr`` the caller had when the launch began (in
a notebook: the running cell).

This is the one place in nbtools that writes to the user's streams directly.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TextIO

__all__ = ["OutputForwarder", "OUTPUT_MODES"]

#: ``all``: every rank; ``rank0``: global rank 0 only; ``none``: nothing.
OUTPUT_MODES = ("all", "rank0", "none")

_POLL_S = 0.02
# A carriage return ends a line too, so progress bars update instead of piling up.
_LINE_END = re.compile(r"[^\r\n]*(?:\r\n|\n|\r)")


class _Tail:
    def __init__(self, path: str, prefix: str, dst: TextIO) -> None:
        self.path = path
        self.prefix = prefix
        self.dst = dst
        self.fh = None
        self.pending = ""

    def pump(self, final: bool) -> None:
        if self.fh is None:
            if not os.path.exists(self.path):
                return
            self.fh = open(self.path, encoding="utf-8", errors="replace", newline="")  # noqa: SIM115
        text = self.pending + self.fh.read()
        pos = 0
        lines = []
        for match in _LINE_END.finditer(text):
            lines.append(self.prefix + match.group(0))
            pos = match.end()
        self.pending = text[pos:]
        if final and self.pending:
            lines.append(self.prefix + self.pending + "\n")
            self.pending = ""
        if lines:
            self.dst.write("".join(lines))
            self.dst.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


class OutputForwarder:
    """Tails the ranks' log files on one thread until :meth:`stop`.

    Args:
        stdouts: ``{rank: path}`` of the files receiving each rank's stdout.
        stderrs: ``{rank: path}`` for stderr.
        mode: one of :data:`OUTPUT_MODES`.
        stdout: where stdout lines go (the caller's ``sys.stdout``).
        stderr: where stderr lines go.
    """

    def __init__(
        self,
        stdouts: dict[int, str],
        stderrs: dict[int, str],
        mode: str,
        stdout: TextIO,
        stderr: TextIO,
    ) -> None:
        ranks = {"all": sorted(stdouts), "rank0": [0], "none": []}[mode]
        self._tails = [_Tail(stdouts[r], f"[rank {r}] ", stdout) for r in ranks if stdouts.get(r)]
        self._tails += [_Tail(stderrs[r], f"[rank {r}] ", stderr) for r in ranks if stderrs.get(r)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> OutputForwarder:
        """Begin forwarding in the background."""
        if self._tails:
            self._thread = threading.Thread(
                target=self._loop, name="nbtools-rank-output", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Forward what is left, then end the thread; safe to call more than once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for tail in self._tails:
            tail.close()

    def _loop(self) -> None:
        while True:
            final = self._stop.wait(_POLL_S)
            for tail in self._tails:
                try:
                    tail.pump(final)
                except (OSError, ValueError):
                    pass  # a closed or vanished destination must not end the launch
            if final:
                return
