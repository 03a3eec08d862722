"""Shared by the launcher's integration tests: a forkserver started up front, a watched stream."""

from __future__ import annotations

import threading

import pytest

from nbtools.launch import _env


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start the interpreter-owned forkserver before the per-test leak checks begin."""
    _env.warm_up()


class Watch:
    """A stand-in for the notebook's output stream that fires an event once all texts appeared."""

    def __init__(self, stream, *texts: str) -> None:
        self.stream, self.texts, self.seen = stream, texts, threading.Event()
        self.buffer = ""

    def write(self, data: str) -> int:
        self.buffer += data
        if all(text in self.buffer for text in self.texts):
            self.seen.set()
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()
