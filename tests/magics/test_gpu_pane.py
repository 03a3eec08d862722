"""``%gpu_pane`` opens the monitor's pane (simulated GPUs here) and closes it again."""

from __future__ import annotations

import threading

import pytest

monitor = pytest.importorskip("nbtools.monitor")
pytest.importorskip("ipywidgets")


def _sampler_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbtools-gpu")]


def test_simulated_pane_opens_replaces_and_closes(ip):
    pane = ip.run_line_magic("gpu_pane", "--simulated 2 --interval 5")
    try:
        assert isinstance(pane, monitor.GPUPane)
        assert pane.status == "polling"
        assert pane.sampler.simulated and pane.sampler.interval == 5
        assert len(pane.sampler.last_sample.gpus) == 2
        second = ip.run_line_magic("gpu_pane", "--simulated 3")
        assert pane.status == "closed" and second.status == "polling"
        assert len(second.sampler.last_sample.gpus) == 3
    finally:
        ip.run_line_magic("gpu_pane", "--close")
    assert second.status == "closed"
    assert _sampler_threads() == []


def test_unloading_the_extension_closes_the_pane(ip):
    pane = ip.run_line_magic("gpu_pane", "--simulated 1")
    ip.run_line_magic("unload_ext", "nbtools")
    ip.run_line_magic("load_ext", "nbtools")
    assert pane.status == "closed"
    assert _sampler_threads() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--simulated 0", "argument --simulated: invalid positive integer value: '0'"),
        ("--interval -1", "argument --interval: invalid positive number value: '-1'"),
        ("--bogus", "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line(ip, capsys, args, message):
    from IPython.core.error import UsageError

    result = ip.run_cell(f"%gpu_pane {args}")
    assert isinstance(result.error_in_exec, UsageError)
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: ") and message in lines[0], lines
    assert _sampler_threads() == []
