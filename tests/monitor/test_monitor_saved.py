"""A notebook with a GPU pane, run by nbclient storing widget state (as JupyterLab saves it).

Two notebooks, each run once in a real kernel: one leaves its pane open with
two hours of history and is saved without ``pane.snapshot()`` (the live view,
then the picture and text the pane redraws by itself while it runs), one
closes it after an event (the output keeps the picture and the text). Checks
the output bundles, the file size, and that nbconvert's HTML without widget
state shows the chart in Chromium.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import json
import logging
import os

import nbformat
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("nbclient") is None, reason="needs nbclient"),
    pytest.mark.skipif(importlib.util.find_spec("anywidget") is None, reason="needs anywidget"),
]

CHROMIUM = "/usr/bin/chromium"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# Two hours at 10 s: the shared sampler of these GPUs is filled on a clock the cell moves,
# then the pane opens on it, as it would after a two-hour run.
OPEN = [
    "import itertools, time\n"
    "from nbtools.monitor import GPUPane, SimulatedBackend, acquire\n"
    "now = itertools.count(int(time.time()) - 7200, 10)\n"
    "clock = lambda: float(next(now))\n"
    "sampler = acquire(SimulatedBackend(num_gpus=2), interval=10, idle_timeout=None,\n"
    "                  clock=clock, start=False)\n"
    "for _ in range(720):\n"
    "    sampler.tick()",
    "import nbtools.monitor._display as shown\n"
    "shown.SNAPSHOT_EVERY_S = 0.5  # the pane's minute, shortened\n"
    "pane = GPUPane(backend=SimulatedBackend(num_gpus=2), interval=10, idle_timeout=None)",
    # The run goes on: an event and a poll; the notebook is saved without pane.snapshot().
    "from nbtools import events\n"
    "events.emit('checkpoint_saved', message='saved step_40', step=40, blocked_s=0.4)\n"
    "asked = time.time()\n"
    "sampler.tick()\n"
    "deadline = time.monotonic() + 120\n"
    "while pane._display.last.time < asked and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)  # until the pane has redrawn its picture by itself",
]
CLOSE = [
    "from nbtools.monitor import GPUPane, SimulatedBackend\n"
    "pane = GPUPane(backend=SimulatedBackend(num_gpus=2), interval=0.5)",
    "from nbtools import events\n"
    "events.emit('eval', message='val loss 1.93', step=10, value=1.93)\n"
    "import time; time.sleep(1.5)",
    "pane.close()",
]


def _run(cells: list[str], path) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    NotebookClient(
        nb,
        timeout=180,
        kernel_name="python3",
        store_widget_state=True,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    nbformat.write(nb, str(path))  # what a save writes
    return nb


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    return {
        "open": (_run(OPEN, folder / "open.ipynb"), folder / "open.ipynb"),
        "closed": (_run(CLOSE, folder / "closed.ipynb"), folder / "closed.ipynb"),
    }


def _pane_outputs(nb) -> list[dict]:
    return [
        o["data"]
        for cell in nb.cells
        for o in cell.get("outputs", [])
        if o.get("output_type") == "display_data"
    ]


def _pane_output(nb) -> dict:
    outputs = [o for o in _pane_outputs(nb) if "image/png" in o]
    assert len(outputs) == 1, [cell.get("outputs") for cell in nb.cells]
    return outputs[0]


def test_an_open_pane_saves_its_view_and_a_picture_of_the_last_minute(saved):
    nb, path = saved["open"]
    view, data = _pane_outputs(nb)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert set(view) == {WIDGET_VIEW, "text/plain"} and view["text/plain"] == ""
    assert view[WIDGET_VIEW]["model_id"] in state
    assert set(data) == {WIDGET_VIEW, "image/png", "text/html", "text/plain"}
    anchor = state[data[WIDGET_VIEW]["model_id"]]  # a live front end draws this hidden box there
    assert anchor["model_name"] == "BoxModel" and anchor["state"]["children"] == []
    assert state[anchor["state"]["layout"].removeprefix("IPY_MODEL_")]["state"]["display"] == "none"
    png = base64.b64decode(data["image/png"])
    assert png.startswith(b"\x89PNG") and len(png) < 200_000
    text = data["text/plain"]
    assert text.startswith("GPU pane · 2 GPUs (simulated) · last sample ")
    # Redrawn by the pane itself, after the event and the poll of the last cell.
    assert " · util " in text and text.endswith("1 event"), text
    size = path.stat().st_size
    snapshot = len(data["image/png"])
    chart = [s for s in state.values() if s["model_name"] == "AnyModel"]
    assert len(chart) == 1 and "_plotly_js" not in json.dumps(state)
    # The picture travels three times: its PNG, inside its HTML, and in the chart's state.
    assert size - 3 * snapshot < 500_000, f"saved notebook {size} bytes, snapshot {snapshot}"


def test_a_closed_pane_keeps_its_picture_and_text(saved):
    nb, path = saved["closed"]
    view, data = _pane_outputs(nb)
    assert view == {"text/plain": ""}  # the live view ended with the pane
    assert set(data) == {"image/png", "text/html", "text/plain"}
    assert data["text/plain"].startswith("GPU pane · 2 GPUs (simulated) · last sample ")
    assert data["text/plain"].endswith("1 event · closed")
    # The HTML is the same picture with alt text, and the text as text beside it.
    assert f'src="data:image/png;base64,{data["image/png"]}"' in data["text/html"]
    assert html.escape(data["text/plain"]) in data["text/html"]
    output = next(
        o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})
    )
    assert output["metadata"]["image/png"]["alt"].startswith("GPU pane, still picture: ")
    assert path.stat().st_size < 500_000


@pytest.mark.browser
@pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Debian's chromium at {CHROMIUM}"
)
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright")
def test_nbconvert_html_without_widget_state_shows_the_chart(saved, tmp_path):
    from nbconvert import HTMLExporter
    from PIL import Image
    from playwright.sync_api import sync_playwright

    nb, _path = saved["open"]
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    del nb.metadata["widgets"]  # as shared without widget state
    exporter = HTMLExporter(template_name="lab")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    exporter.log.addHandler(handler)
    try:
        body, _ = exporter.from_notebook_node(nb)
    finally:
        exporter.log.removeHandler(handler)
    assert not [m for m in said if "Alternative text is missing" in m], said
    page_path = tmp_path / "pane.html"
    page_path.write_text(body, encoding="utf-8")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(page_path.as_uri())
            image = page.locator(".jp-OutputArea-output img").first
            image.wait_for(timeout=30_000)
            page.wait_for_function(
                "(img) => img.complete && img.naturalWidth > 0",
                arg=image.element_handle(),
                timeout=30_000,
            )
            shot = Image.open(io.BytesIO(image.screenshot())).convert("RGB")
            alt = image.get_attribute("alt")
            text = page.locator(".nbtools-gpu-still-text").first.inner_text()
        finally:
            browser.close()
    assert alt.startswith("GPU pane, still picture: utilization, memory and temperature"), alt
    assert text.startswith("GPU pane · 2 GPUs (simulated) · last sample "), text  # as text
    assert shot.width >= 800
    # The chart's area: the lower two thirds (panels), where the curves are drawn.
    area = shot.crop((60, shot.height // 3, shot.width - 20, shot.height - 120))
    colors = area.getcolors(maxcolors=1 << 16) or []
    drawn = sum(count for count, rgb in colors if rgb != (255, 255, 255))
    assert drawn > 0.03 * area.width * area.height, "no chart in the exported notebook"
    blue = sum(count for count, (r, g, b) in colors if b > 150 and r < 90 and 90 < g < 150)
    orange = sum(count for count, (r, g, b) in colors if r > 220 and 100 < g < 160 and b < 60)
    assert blue > 200 and orange > 200, "the two GPUs' lines are not in the picture"
