"""Live forwarding of every rank's output into the caller's streams, line by line.

torch's elastic machinery redirects each rank's stdout and stderr at the file
descriptor level (so C-level prints are captured too) into log files; one
thread tails all of them and writes complete lines, prefixed ``[rank N] ``,
to the ``sys.stdout``/``sys.stderr`` the caller had when the launch began (in
a notebook: the running cell).

Progress bars. A notebook's output area has one "current line" per stream,
which a carriage return rewrites, and no cursor movement: N ranks rewriting
that one line would overwrite each other's bars, and one updating line per
rank cannot be drawn. So, per destination stream:

- Lines ending in a newline are printed as they are, each with exactly one
  ``[rank N] `` prefix (torch's own ``[rankN]:`` prefix is replaced, not doubled).
- Carriage-return updates (tqdm, Hugging Face bars) are shown for global rank
  0 only, as one live line that each update rewrites. The other ranks' updates
  are dropped; their bars' final lines (which end in a newline) still print.
- Whenever a line is printed while rank 0's bar is live, the bar is erased,
  the line printed, and the bar drawn again below it, as ``tqdm.write`` does.
- Cursor-movement and erase escapes (``ESC[A`` and the like) are removed: they
  would move into other ranks' lines. Colours (``ESC[...m``) are kept.

This is the one place in nbtools that writes to the user's streams directly.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from typing import TextIO

from nbtools.launch._rank import DISPLAY_MARK, show_display
from nbtools.launch._stack_dumps import StackFolder

__all__ = ["OutputForwarder", "OUTPUT_MODES"]

#: ``all``: every rank; ``rank0``: global rank 0 only; ``none``: nothing.
OUTPUT_MODES = ("all", "rank0", "none")

_POLL_S = 0.02
# A segment ends with a newline (a line) or a lone carriage return (an update).
_SEGMENT = re.compile(r"([^\r\n]*)(\r\n|\n|\r)")
# Control sequences other than colours (SGR, ending in "m").
_CURSOR_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-HJKSTfhlsu]")
# tqdm draws bar number n (position=n) as n newlines, the bar, and n cursor-ups.
_MOVED_BAR = re.compile(r"(\n+)([^\n\x1b]*)\x1b\[(\d*)A")
# A trailing newline run that may be the start of such a positioned bar.
_MAYBE_MOVE = re.compile(r"\n+(?:\r[^\n]*)?$")
# How long such a run waits for the cursor-up that would make it a bar position: tqdm
# writes the newlines, the bar and the cursor-ups in three writes, which a busy machine
# can spread over several polls. A line printed last is shown at most this much later.
_HOLD_S = 0.5
# The file name of code sent by value (see ``_sources``).
_DYNAMIC = '"<dynamic-code>"'
_WARNED = "<dynamic-code>:"


class _Sink:
    """One destination stream and the live (carriage-return) line shown at its bottom."""

    def __init__(self, dst: TextIO) -> None:
        self.dst = dst
        self.live = ""
        try:
            self.tty = bool(dst.isatty())
        except (AttributeError, ValueError):
            self.tty = False

    def line(self, text: str) -> str:
        """Text that prints ``text`` as a finished line above the live line."""
        if not self.live:
            return text + "\n"
        # Replace the live line, then draw it again under the new line.
        return "\r" + self._pad(text, self.live) + "\n" + self.live

    def finish(self, text: str) -> str:
        """Text that turns the live line into the finished line ``text``."""
        old, self.live = self.live, ""
        return ("\r" + self._pad(text, old) if old else text) + "\n"

    def update(self, text: str) -> str:
        """Text that makes ``text`` the live line."""
        old, self.live = self.live, text
        return "\r" + self._pad(text, old)

    def _pad(self, text: str, old: str) -> str:
        # A terminal overwrites in place; Jupyter replaces the whole line.
        return text + " " * (len(old) - len(text)) if self.tty else text


class _Tail:
    def __init__(
        self, path: str, rank: int, sink: _Sink, shown: bool, owner: OutputForwarder
    ) -> None:
        self.owner = owner
        self.path = path
        self.rank = rank
        self.prefix = f"[rank {rank}] "
        self.torch_prefix = re.compile(rf"^\[rank{rank}\]:\s?")
        self.sink = sink
        self.shown = shown  # read but discarded when False (still counts as activity)
        self.updates = shown and rank == 0  # whether carriage-return updates are shown
        self.fh = None
        self.pending = ""
        self.after_cr = False  # the text pending follows a carriage return: a bar in progress
        self.hold_until: float | None = None  # until when trailing newlines are held back
        self.bars = False  # this rank has drawn a carriage-return bar
        self.stacks = StackFolder()  # this stream's stack dumps, folded to the user's frames

    def pump(self, final: bool) -> bool:
        """Forward what the file has gained; True when it had anything new."""
        if self.fh is None:
            if not os.path.exists(self.path):
                return False
            self.fh = open(self.path, encoding="utf-8", errors="replace", newline="")
        new = self.fh.read()
        if not self.shown:
            return bool(new)
        if new and self.after_cr and self.pending and new[0] not in "\r\n\x1b":
            # A bar is written whole ("\r" + state); text after it starts a new line.
            self.pending += "\r"
        text = _CURSOR_ESCAPE.sub("", _MOVED_BAR.sub(_as_update, self.pending + new))
        self.bars = self.bars or "\r" in new
        held = ""
        match = None if final else _MAYBE_MOVE.search(text)
        if match:
            # Wait for the cursor-up that would make these newlines a bar position: a moment
            # on a rank that draws bars, else one poll (lines keep their order across ranks).
            now, first = time.monotonic(), self.hold_until is None
            if first:
                self.hold_until = now + (_HOLD_S if self.bars else 0.0)
            if (first and new) or now < self.hold_until:
                text, held = text[: match.start()], text[match.start() :]
        if not held:
            self.hold_until = None
        out = []
        pos = 0
        for match in _SEGMENT.finditer(text):
            pos = match.end()
            body, end = match.group(1), match.group(2)
            if end == "\r":
                self.after_cr = True
                if self.updates and body.strip():
                    out.append(self.sink.update(self._prefixed(body)))
                continue
            if DISPLAY_MARK in body:
                # Rich output (rank 0): shown by the kernel's display, after the text before it.
                if out:
                    self.sink.dst.write("".join(out))
                    self.sink.dst.flush()
                    out = []
                fallback = show_display(body, self.rank)
                if fallback:
                    out.append(self._finished(self._prefixed(fallback)))
                self.after_cr = False
                continue
            folded, in_dump = self.stacks.feed(body)
            out.extend(self._finished(self._prefixed(line)) for line in folded)
            if not in_dump:
                out.append(self._finished(self._prefixed(body)))
            self.after_cr = False
        if not new or final:
            # A dump arrives whole within a read or two: fold it once the rank is quiet.
            out.extend(self._finished(self._prefixed(line)) for line in self.stacks.flush())
        rest = text[pos:]
        self.pending = rest + held
        if final and self.pending:
            out.append(self._finished(self._prefixed(self.pending)))
            self.pending = ""
        elif new and self.after_cr and self.updates and rest.strip():
            # tqdm writes "\r" + state: what follows the last carriage return is the bar now.
            out.append(self.sink.update(self._prefixed(rest)))
        if out:
            self.sink.dst.write("".join(out))
            self.sink.dst.flush()
        return bool(new)

    def _finished(self, line: str) -> str:
        if self.after_cr and self.updates and self.sink.live.startswith(self.prefix):
            return self.sink.finish(line)  # this rank's own bar ends as this line
        return self.sink.line(line)

    def _prefixed(self, body: str) -> str:
        body = self.torch_prefix.sub("", body, count=1)
        localize = self.owner.localize
        if localize is not None and (_DYNAMIC in body or body.startswith(_WARNED)):
            # a frame of a stack dump, or a warning from code sent by value
            return "\n".join(self.prefix + line for line in localize(body).split("\n"))
        return self.prefix + body

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def _as_update(match: re.Match) -> str:
    """A positioned bar's newlines and cursor-ups become one carriage-return update."""
    newlines, ups = len(match.group(1)), int(match.group(3) or 1)
    if newlines < ups:
        return match.group(0)  # not tqdm's pattern: only the escape is removed later
    return "\n" * (newlines - ups) + "\r" + match.group(2) + "\r"


class OutputForwarder:
    """Tails the ranks' log files on one thread until :meth:`stop`.

    Args:
        stdouts: ``{rank: path}`` of the files receiving each rank's stdout.
        stderrs: ``{rank: path}`` for stderr.
        mode: one of :data:`OUTPUT_MODES`.
        stdout: where stdout lines go (the caller's ``sys.stdout``).
        stderr: where stderr lines go.
        localize: rewrites a line of a stack dump that names ``<dynamic-code>``
            (see ``_sources.localizer``); settable while forwarding.

    Attributes:
        last_output: ``time.monotonic()`` of the last output seen from any rank
            (the start time until then), whether or not it was shown.
    """

    def __init__(
        self,
        stdouts: dict[int, str],
        stderrs: dict[int, str],
        mode: str,
        stdout: TextIO,
        stderr: TextIO,
        localize: Callable[[str], str] | None = None,
    ) -> None:
        shown = {"all": set(stdouts), "rank0": {0}, "none": set()}[mode]
        out, err = _Sink(stdout), _Sink(stderr)
        self.localize = localize
        self._tails = [_Tail(p, r, out, r in shown, self) for r, p in sorted(stdouts.items()) if p]
        self._tails += [_Tail(p, r, err, r in shown, self) for r, p in sorted(stderrs.items()) if p]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_output = time.monotonic()

    @property
    def stacks(self) -> dict[int, str]:
        """Every rank's stack dumps as they were written, in full (the cell shows them folded)."""
        dumps: dict[int, list[str]] = {}
        for tail in self._tails:
            if tail.stacks.full:
                dumps.setdefault(tail.rank, []).extend(tail.stacks.full)
        return {rank: "\n".join(lines) + "\n" for rank, lines in sorted(dumps.items())}

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

    def poll(self, final: bool = False) -> None:
        """Forward what every rank has written since the last poll (``final``: flush partials)."""
        for tail in self._tails:
            try:
                if tail.pump(final):
                    self.last_output = time.monotonic()
            except (OSError, ValueError):
                pass  # a closed or vanished destination must not end the launch

    def _loop(self) -> None:
        while True:
            final = self._stop.wait(_POLL_S)
            self.poll(final)
            if final:
                return
