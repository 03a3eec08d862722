"""The live pane's world-size row in JupyterLab: it appears when the run shrinks, polls carry it on.

Runs ``%gpu_pane --simulated 4`` in a real JupyterLab page (headless Chromium); in the kernel,
a launch of 4 processes, then a shrink to 3, are emitted as the launcher and the local backend
emit them. Reads what plotly drew: a low row under the GPU panels whose step line goes from 4
to 3, whose hover says the cause and the step, and which each poll carries on to its time, on
the x axis the other panels match.
"""

from __future__ import annotations

import json

from _lab import MARKS, chromium, jupyterlab, notebook, open_notebook

pytestmark = MARKS

EVENTS = """\
import time
from nbtools import events
events.emit("launch", "4 ranks (local)", world_size=4, cluster="local", startup_s=1.2)
time.sleep(1.5)  # a few polls: no row yet, the size never changed
cause = "rank 3 died (SIGKILL) and slot 3 failed to start twice"
events.emit("shrunk", cause + ": continuing on 3 of 4 processes from step 4 (live)",
            from_world=4, to_world=3, cause=cause, slots="3", step=3, tier="live",
            attempt=2, seconds=0.4)
"""

NOTEBOOK = notebook(
    ext="%load_ext nbtools",
    pane="%gpu_pane --simulated 4 --interval 0.5",
    events=EVENTS,
)

WORLD = """() => {
  const plot = document.querySelector('.nbtools-gpu-plot');
  const L = plot._fullLayout;
  const line = plot.data.find((t) => t.name === 'processes');
  if (!line) return null;
  const axis = 'xaxis' + (line.xaxis || 'x').slice(1);
  return {x: line.x.slice(), y: line.y.slice(), text: line.customdata.slice(),
    shape: line.line.shape, matches: L[axis].matches || null, type: L[axis].type,
    axes: Object.keys(L).filter((k) => /^xaxis\\d*$/.test(k)).length};
}"""


def test_the_world_size_row_appears_at_a_shrink_and_follows_the_polls(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "world.ipynb").write_text(json.dumps(NOTEBOOK))
    console: list[str] = []
    with jupyterlab(tmp_path, root) as (base, token), chromium() as browser:
        page = open_notebook(browser, f"{base}/lab/tree/world.ipynb?token={token}", console)
        page.wait_for_function(
            "() => { const p = document.querySelector('.nbtools-gpu-plot');"
            " return p && p.data && p.data.some((t) => t.name === 'processes'); }",
            timeout=120_000,
        )
        first = page.evaluate(WORLD)
        assert first["shape"] == "hv" and first["type"] == "date", first
        assert first["axes"] == 4 and first["matches"] is None, first  # the bottom row's axis
        assert first["y"][:2] == [4, 3], first
        assert first["text"][1] == (
            "3 of 4 processes: rank 3 died (SIGKILL) and slot 3 failed to start twice,"
            " from step 4 (live)"
        ), first
        # Polls carry the line on: more points, later, at the same size.
        page.wait_for_function(
            f"() => {{ const t = document.querySelector('.nbtools-gpu-plot').data"
            f".find((t) => t.name === 'processes'); return t.x.length >= {len(first['x']) + 2}; }}",
            timeout=60_000,
        )
        later = page.evaluate(WORLD)
        assert later["x"][-1] > first["x"][-1], (first, later)
        assert set(later["y"][2:]) == {3} and later["text"][-1] == first["text"][1], later
        assert not [m for m in console if "ignored" in m], console  # "ignored xaxis.matches"
