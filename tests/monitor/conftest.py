"""Fixtures for the monitor tests: a fake clock, a stand-in ``pynvml``, a recording comm."""

from __future__ import annotations

import sys
import types

import pytest
from _monitor_fakes import FakeGPU, RecordingComm, make_fake_pynvml


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def driven(clock):
    """A shared sampler of simulated GPUs on the fake clock, with no thread: ``driven(n,
    **options)`` returns it (polled with ``sampler.tick()``); panes on the same GPUs use it."""
    from nbtools.monitor import SimulatedBackend, acquire, release

    samplers = []

    def start(num_gpus: int = 2, **options):
        options.setdefault("interval", 10)
        options.setdefault("idle_timeout", None)
        samplers.append(acquire(SimulatedBackend(num_gpus), clock=clock, start=False, **options))
        return samplers[-1]

    yield start
    for sampler in samplers:
        release(sampler)


@pytest.fixture
def fake_pynvml(monkeypatch):
    """Install a stand-in ``pynvml``: ``fake_pynvml(gpus, init_error=None)`` returns the module."""

    def install(gpus: list[FakeGPU], init_error: str | None = None) -> types.ModuleType:
        module = make_fake_pynvml(gpus, init_error)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    return install


@pytest.fixture
def comms(monkeypatch):
    """Route every new widget's comm to a :class:`RecordingComm`; returns the list of comms."""
    import comm as comm_package

    created: list[RecordingComm] = []

    def create_comm(**kwargs: object) -> RecordingComm:
        created.append(RecordingComm(**kwargs))
        return created[-1]

    monkeypatch.setattr(comm_package, "create_comm", create_comm)
    return created


@pytest.fixture(autouse=True)
def outside_a_cell(monkeypatch):
    """Panes here are built outside a running cell.

    An IPython shell that an earlier test in this process created would
    otherwise count as a running cell (activity), and no pane would ever idle.
    Tests about cells patch ``_ipython`` themselves. Where ipywidgets is not
    installed (a GPU machine's image, say), no pane is built and the NVML tests run.
    """
    try:
        import nbtools.monitor.pane as pane_module
    except ImportError:
        return

    monkeypatch.setattr(pane_module, "_ipython", lambda: None)
