"""The GPU pane in a real JupyterLab, in headless Chromium (Debian's), driven by Playwright.

Starts JupyterLab on loopback with a token in a temporary directory, runs a
notebook that shows ``GPUPane(backend=SimulatedBackend(num_gpus=4))`` and then
a real 2-rank ``@distributed`` training run that saves checkpoints, waits for a
slow sample and loses a rank once. Checks 4 lines per panel, the run's events
drawn on the time axis (bands, lines, markers) and listed under the charts
while the training cell still runs (plotly.js reaches the page in a custom
message the kernel pushes, not in the widget state), a second pane that
reuses the page's copy, and that Refresh
moves the last-sample time; saves a screenshot (to ``assets/gpu_pane.png``
when ``NBTOOLS_UPDATE_ASSETS=1``, else to the test's temporary directory), and
stops JupyterLab and the browser.

While the pane runs, its saved picture (the output under the live view) is
replaced every few seconds (the minute, shortened): the live view stays the
same view, keeps drawing polls, and its picture output stays hidden. Where
``notebook`` is installed, the same server then serves the pane's cell in
Jupyter Notebook 7, checked the same way.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from _lab import MARKS, chromium, jupyterlab, notebook, open_notebook

ASSET = Path(__file__).resolve().parents[2] / "assets" / "gpu_pane.png"

pytestmark = MARKS

# A notebook's training cell: everything defined in the cell, one slow read, one lost rank.
TRAINING = """\
import os, pathlib, tempfile
from nbtools import distributed

work = pathlib.Path(tempfile.mkdtemp(dir="."))
(work / "volume").mkdir()
for i in range(48):
    (work / "volume" / f"{i:03d}.txt").write_text(str(i))

@distributed(processes=2, max_restarts=1, output="none")
def train(work):
    import signal, time
    import torch, torch.distributed as dist
    from torch.utils.data import IterableDataset
    from nbtools import events
    from nbtools.checkpoint import CheckpointManager
    from nbtools.data import DataLoader, VolumeDataset
    from nbtools.runtime import get_restart_count

    attempt, rank = get_restart_count(), dist.get_rank()

    class Numbers(IterableDataset):
        def __init__(self, files):
            self.files = files
        def __iter__(self):
            for position, path in enumerate(self.files):
                time.sleep(2.0 if position == 9 and attempt == 0 else 0.1)
                yield torch.tensor([float(open(path).read())])
        def state_dict(self):
            return self.files.state_dict()
        def load_state_dict(self, state):
            self.files.load_state_dict(state)

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    files = VolumeDataset(f"{work}/volume", cache_dir=f"{work}/cache", shuffle=True, seed=0)
    loader = DataLoader(Numbers(files), batch_size=2, num_workers=0)
    with CheckpointManager(f"{work}/ckpt", every=4) as ckpt:
        step = ckpt.restore(model=model, optimizer=optimizer, data=loader)
        events.emit("rank_started", message=f"attempt {attempt}", step=step)
        for batch in loader:
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            ckpt.maybe_save(step, model=model, optimizer=optimizer, data=loader)
            if step % 5 == 0 and rank == 0:
                events.emit("eval", message=f"loss {loss.item():.1f}", step=step, value=loss.item())
            if attempt == 0 and step == 7:
                ckpt.wait(); events.flush(); dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            step += 1
    return step

print(train.distributed(str(work)))
"""

NOTEBOOK = notebook(
    pane="import nbtools.monitor._display as shown\n"
    "shown.SNAPSHOT_EVERY_S = 4  # the pane's minute, shortened\n"
    "from nbtools.monitor import GPUPane, SimulatedBackend\n"
    "pane = GPUPane(interval=0.5, backend=SimulatedBackend(num_gpus=4, speed=90))",
    train=TRAINING,
    second="second = GPUPane(interval=0.5, backend=SimulatedBackend(num_gpus=4, speed=90))",
    nvml="third = GPUPane(interval=0.5)  # NVML: no GPU on a machine without one",
)


# The text of the first cell's picture output, as the front end's notebook model holds it.
PICTURE_TEXT = """() => {
  const outputs = window.jupyterapp.shell.currentWidget.content.model.cells.get(0).outputs;
  for (let i = 0; i < outputs.length; i++) {
    const data = outputs.get(i).data;
    if (data["image/png"]) return data["text/plain"];
  }
  return null;
}"""
# Display of the output rows holding the picture's hidden widget (none while the live view is on).
PICTURE_ROWS = """() => Array.from(document.querySelectorAll('.jp-OutputArea-child'))
  .filter((c) => c.querySelector('.nbtools-gpu-still-anchor'))
  .map((c) => getComputedStyle(c).display + ' ' + c.getBoundingClientRect().height)"""


def _picture_follows_the_run(page) -> str:
    """The first pane's picture output is hidden and replaced while its live view stays the same.

    Returns the picture's first text. The live view is the same element
    throughout (never re-rendered) and still draws polls after the picture changed.
    """
    rows = page.evaluate(PICTURE_ROWS)  # one per pane shown so far
    assert rows and set(rows) == {"none 0"}, rows
    assert page.locator(".jp-Cell").first.locator(".jp-OutputArea img").count() == 0
    page.evaluate("() => { document.querySelector('.nbtools-gpu').dataset.view = 'first'; }")
    picture = page.evaluate(PICTURE_TEXT)
    assert picture and picture.startswith("GPU pane · 4 GPUs (simulated)"), picture
    page.wait_for_function(f"(t) => ({PICTURE_TEXT})() !== t", arg=picture, timeout=60_000)
    moved = page.locator(".nbtools-gpu-last").first.get_attribute("data-time")
    page.wait_for_function(
        "(t) => document.querySelector('.nbtools-gpu-last').dataset.time !== t",
        arg=moved,
        timeout=30_000,
    )
    assert page.evaluate("() => document.querySelector('.nbtools-gpu').dataset.view") == "first"
    return picture


# The step-rate row of the first pane: rank traces, their subplot and its title.
RATE_ROW = """() => { const p = document.querySelector('.nbtools-gpu-plot');
  const ranks = p.data.filter((t) => /^rank \\d/.test(t.name));
  return {names: ranks.map((t) => t.name), points: ranks.map((t) => t.x.length),
    widths: ranks.map((t) => t.line.width),
    subplots: p.querySelectorAll('.cartesianlayer > .subplot').length,
    titles: (p.layout.annotations || []).map((a) => a.text)}; }"""
# Flags as the kernel's watchdog emits them (in the kernel), one of each kind.
FLAGS = (
    "import time\n"
    "from nbtools import events\n"
    "events.emit('straggler', 'rank 0 on node-b at 0.62 of the median step rate since 12:04:00',"
    " rank=0, node='node-b', since=time.time() - 60, score=0.62)\n"
    "events.emit('hang', 'rank 1 on node-b made no progress for 90 s', rank=1, node='node-b',"
    " since=time.time() - 90, stalled_s=90.0, collective='all_reduce #1812', entered=True)\n"
)


def _check_step_rates_and_flags(page) -> None:
    """The training's ranks have a step-rate row; flags are listed, drawn bold and banded."""
    page.wait_for_function(
        "() => { const p = document.querySelector('.nbtools-gpu-plot');"
        " return p.data.filter((t) => /^rank \\d/.test(t.name) && t.x.length >= 2).length === 2; }",
        timeout=60_000,
    )
    row = page.evaluate(RATE_ROW)
    assert row["subplots"] == 4 and "Steps per second, by rank" in row["titles"], row
    page.evaluate(
        "(code) => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
        ".requestExecute({code})",
        FLAGS,
    )
    page.wait_for_function(
        "() => Array.from(document.querySelector('.nbtools-gpu-events')"
        ".querySelectorAll('.nbtools-gpu-event')).filter((e) => e.dataset.category === 'hang'"
        " || e.dataset.category === 'straggler').length === 2",
        timeout=60_000,
    )
    texts = page.evaluate(
        "() => Array.from(document.querySelector('.nbtools-gpu-events')"
        ".querySelectorAll('.nbtools-gpu-event')).map((e) => e.dataset.kind + ': ' +"
        " e.querySelector('.nbtools-gpu-event-text').textContent)"
    )
    assert "hang: rank 1 on node-b stalled 90 s in all_reduce #1812" in texts, texts
    assert "straggler: rank 0 on node-b at 0.62 of the median step rate since 12:04:00" in texts, (
        texts
    )
    row = page.evaluate(RATE_ROW)
    assert row["names"] == ["rank 0 (straggler)", "rank 1 (hang)"], row
    assert row["widths"] == [3.5, 3.5], row
    bands = page.evaluate(
        "() => (document.querySelector('.nbtools-gpu-plot').layout.shapes || [])"
        ".filter((s) => s.type === 'rect' && s.fillcolor === '#b91c1c').length"
    )
    assert bands == row["subplots"]  # the hang's band, from where it began, on every panel


def _check_notebook7(browser, url: str) -> None:
    """The pane's first cell in Jupyter Notebook 7: drawn, polling, its picture hidden and kept fresh."""
    page = browser.new_page(viewport={"width": 1100, "height": 1000})
    try:
        page.goto(url)
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
            " && window.jupyterapp.shell.currentWidget.sessionContext"
            " && window.jupyterapp.shell.currentWidget.sessionContext.session"
            " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
            timeout=60_000,
        )
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_function(
            "() => document.querySelectorAll('.nbtools-gpu-plot .trace.scatter').length >= 12",
            timeout=60_000,
        )
        _picture_follows_the_run(page)
        assert page.locator(".nbtools-gpu").count() == 1
    finally:
        page.close()


@pytest.mark.timeout(600)  # a real training run and two front ends, on a busy machine
def test_pane_renders_and_refreshes_in_jupyterlab(tmp_path):
    shot = ASSET if os.environ.get("NBTOOLS_UPDATE_ASSETS") == "1" else tmp_path / "gpu_pane.png"
    root = tmp_path / "root"
    root.mkdir()
    (root / "pane.ipynb").write_text(json.dumps(NOTEBOOK))
    (root / "seven.ipynb").write_text(json.dumps({**NOTEBOOK, "cells": NOTEBOOK["cells"][:1]}))
    with jupyterlab(tmp_path, root) as (base, token), chromium() as browser:
        page = open_notebook(browser, f"{base}/lab/tree/pane.ipynb?token={token}")
        pane = page.locator(".nbtools-gpu").first
        pane.wait_for(timeout=60_000)
        page.wait_for_function(
            "() => document.querySelectorAll('.nbtools-gpu-plot .trace.scatter').length >= 12",
            timeout=30_000,
        )
        # Lines actually drawn (an SVG path per trace) in each of the three panels.
        per_panel = page.evaluate(
            "() => Array.from(document.querySelector('.nbtools-gpu-plot')"
            ".querySelectorAll('.cartesianlayer > .subplot')).map((s) => "
            "s.querySelectorAll('.trace.scatter path.js-line').length)"
        )
        # (A row of step rates joins below them once the training's ranks report.)
        assert per_panel[:3] == [4, 4, 4], f"lines per panel: {per_panel}"
        picture = _picture_follows_the_run(page)
        assert "SIMULATED" in page.locator(".nbtools-gpu-source").first.inner_text()
        status = page.locator(".nbtools-gpu-status").first
        assert "polling" in status.inner_text() and "simulated" in status.inner_text()
        # The run's events reach the pane with its polls: drawn and listed.
        page.wait_for_function(
            "() => Array.from(document.querySelectorAll('.nbtools-gpu-event'))"
            ".some((e) => e.dataset.kind === 'checkpoint_restored')",
            timeout=240_000,
        )
        page.wait_for_function(
            "() => document.querySelectorAll('.nbtools-gpu').length >= 2",
            timeout=120_000,
        )
        drawn = page.evaluate(
            "() => { const p = document.querySelector('.nbtools-gpu-plot');"
            " const ev = p.data[p.data.length - 1];"
            " return {shapes: (p.layout.shapes || []).map((s) => s.type), name: ev.name,"
            " hover: ev.customdata || [],"
            " listed: Array.from(document.querySelector('.nbtools-gpu-events')"
            ".querySelectorAll('.nbtools-gpu-event')).map((e) => e.dataset.kind)}; }"
        )
        kinds = {text.split("</b>")[0].removeprefix("<b>") for text in drawn["hover"]}
        assert drawn["name"] == "events", drawn
        assert {
            "launch",
            "checkpoint_saved",
            "input_stall",
            "restart",
            "checkpoint_restored",
            "rank_started",
            "eval",
        } <= kinds, kinds
        assert "line" in drawn["shapes"], drawn  # launch, restart
        assert "rect" in drawn["shapes"], drawn  # the input stalls
        assert len(drawn["listed"]) == 8, drawn  # the newest events, under the charts
        # Hovering an event's marker shows its details.
        marker = pane.locator(".subplot.xy .scatterlayer .trace").last.locator(".points path").last
        pane.locator(".nbtools-gpu-plot").scroll_into_view_if_needed()
        box = marker.bounding_box()
        # The marker sits on the top edge of the plot area: hover its lower half.
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] * 0.8)
        page.wait_for_function(
            "() => /rank|step|attempt/.test(document.querySelector("
            "'.nbtools-gpu-plot .hoverlayer').textContent)",
            timeout=30_000,
        )
        # The second pane reused the page's plotly.js and drew the same events.
        page.wait_for_function(
            "() => { const p = document.querySelectorAll('.nbtools-gpu-plot');"
            " if (p.length < 2 || !p[1].data || p[1].data.length !== p[0].data.length)"
            " return false; const n = p[0].data.length - 1;"
            " return n >= 12 && p[1].data[n].x.length === p[0].data[n].x.length; }",
            timeout=60_000,
        )
        _check_step_rates_and_flags(page)
        page.wait_for_function(
            "() => document.querySelector('.nbtools-gpu-plot').data[0].x.length >= 16",
            timeout=30_000,
        )
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.mouse.move(0, 0)  # no hover label in the picture
        # JupyterLab's notifications (its question about news) stay out of the picture.
        page.add_style_tag(
            content=".Toastify, .jp-Notification-Toast { display: none !important; }"
        )
        page.locator(".jp-OutputArea-output", has=pane).first.screenshot(path=str(shot))

        # Paused, only Refresh can move the last-sample time.
        page.locator(".widget-button", has_text="Pause").first.click()
        page.wait_for_function(
            "() => document.querySelector('.nbtools-gpu-status').dataset.status === 'paused'",
            timeout=30_000,
        )
        last = page.locator(".nbtools-gpu-last").first
        before = last.get_attribute("data-time")
        assert before, "the pane shows no last-sample time"
        page.locator(".widget-button", has_text="Refresh").first.click()
        page.wait_for_function(
            "(t) => document.querySelector('.nbtools-gpu-last').dataset.time !== t",
            arg=before,
            timeout=30_000,
        )
        assert int(last.get_attribute("data-time")) > int(before)
        assert status.get_attribute("data-status") == "paused"
        # Minutes of pictures later: still the first view, one per pane, none re-rendered.
        assert page.evaluate(PICTURE_TEXT) != picture
        assert page.evaluate("() => document.querySelector('.nbtools-gpu').dataset.view") == "first"
        assert set(page.evaluate(PICTURE_ROWS)) == {"none 0"}

        # A pane with no GPU to poll lists events emitted after it is on the page.
        third = page.locator(".nbtools-gpu-status").nth(2)
        third.wait_for(timeout=60_000)
        if third.get_attribute("data-status") == "unavailable":
            page.evaluate(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                ".requestExecute({code: 'from nbtools import events; "
                'events.emit("note", message="after the pane")\'})'
            )
            page.wait_for_function(
                "() => Array.from(document.querySelectorAll('.nbtools-gpu')[2]"
                ".querySelectorAll('.nbtools-gpu-event')).some((e) => e.dataset.kind === 'note')",
                timeout=60_000,
            )
        assert page.locator(".nbtools-gpu").count() == 3  # one view per pane, none re-rendered

        # Notebook 7, served by the same server: the same live pane and hidden picture.
        # Run where `notebook` is installed (not in the test extra: its own kernel and
        # page cost about 20 s on a busy machine).
        if importlib.util.find_spec("notebook") is not None:
            _check_notebook7(browser, f"{base}/notebooks/seven.ipynb?token={token}")
    assert shot.stat().st_size > 10_000
