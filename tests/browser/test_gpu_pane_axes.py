"""The live pane's panels share one time axis in JupyterLab, and its events sit at their times.

Runs ``%gpu_pane --simulated 4`` in a real JupyterLab page (headless Chromium); in the kernel,
two ranks report progress (the chart is rebuilt with their step-rate row), then a restart (a
line) and a checkpoint save (a band) arrive with the polls that follow. Reads what plotly drew:
every panel's x axis is a date axis matching the bottom one, with the same range, at every
moment (looked at every 50 ms: an event drawn after the last rebuild once made the first
panel's axis a linear one of epoch milliseconds, and plotly said "ignored xaxis.matches");
plotly warned about no axis; the restart's line crosses every panel at the pixel where that
panel's axis puts its time. A pane on this machine's GPUs (none here) says how to try the
pane with simulated ones.
"""

from __future__ import annotations

import json
import time

from _lab import MARKS, chromium, jupyterlab, notebook, open_notebook

pytestmark = MARKS

EVENTS = """\
import time
from nbtools import events
def report(times):
    for _ in range(times):
        for rank in (0, 1):
            events.emit("progress", rank=rank, steps=10 * int(time.time() * 2))
        time.sleep(0.5)
report(6)  # two ranks report: the chart is rebuilt with their step-rate row
events.emit("restart", message="restarting all 2 ranks (restart 1 of 2)", attempt=1)
events.emit("checkpoint_saved", message="saved step_8", step=8, blocked_s=0.8)
report(4)  # the events arrive with polls, after the last rebuild
"""


NOTEBOOK = notebook(
    ext="%load_ext nbtools",
    pane="%gpu_pane --simulated 4 --interval 0.5",
    events=EVENTS,
    nvml="from nbtools.monitor import GPUPane\nhere = GPUPane(interval=0.5)",
)

# Every distinct state of the x axes from now on (types and matches), looked at every
# 50 ms: a drawing that plotly abandons half way never says "afterplot".
RECORD = """() => { const plot = document.querySelector('.nbtools-gpu-plot');
  window.__axes = [];
  window.__recording = setInterval(() => {
    const L = plot._fullLayout;
    const now = Object.keys(L).filter((k) => /^xaxis\\d*$/.test(k)).sort()
      .map((k) => `${k}:${L[k].type}:${L[k].matches || ''}`).join(' ');
    if (window.__axes[window.__axes.length - 1] !== now) window.__axes.push(now);
  }, 50); }"""

# Per panel (x axis): its type, range in epoch ms, what it matches, its pixel offset and
# length, and where its axis puts the restart's time; then the restart's drawn lines.
AXES = """() => {
  const plot = document.querySelector('.nbtools-gpu-plot');
  const L = plot._fullLayout;
  const events = plot.data[plot.data.length - 1];
  const i = events.customdata.findIndex((t) => t.startsWith('<b>restart</b>'));
  const t = events.x[i];
  const svg = plot.querySelector('.main-svg').getBoundingClientRect();
  const ids = Object.keys(L).filter((k) => /^xaxis\\d*$/.test(k)).sort();
  const panels = ids.map((k) => {
    const x = L[k], y = L[x.anchor === 'free' ? 'yaxis' : 'yaxis' + x.anchor.slice(1)];
    return {id: k, type: x.type, range: x.range.map((v) => x.r2l(v)), matches: x.matches || null,
      at: x._offset + x.l2p(x.d2l(t)), top: y._offset, bottom: y._offset + y._length};
  });
  const lines = Array.from(plot.querySelectorAll('.shapelayer path')).map((p) => {
    const r = p.getBoundingClientRect();
    return {x: r.left + r.width / 2 - svg.left, top: r.top - svg.top, bottom: r.bottom - svg.top,
      width: r.width, stroke: p.style.stroke};
  }).filter((l) => l.width < 4 && l.stroke.replace(/\\s/g, '') === 'rgb(234,88,12)');
  return {panels, lines, time: t};
}"""


def test_every_panel_shares_the_time_axis_and_draws_events_at_their_time(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "axes.ipynb").write_text(json.dumps(NOTEBOOK))
    console: list[str] = []
    with jupyterlab(tmp_path, root) as (base, token), chromium() as browser:
        page = open_notebook(browser, f"{base}/lab/tree/axes.ipynb?token={token}", console)
        page.wait_for_function(
            "() => { const p = document.querySelector('.nbtools-gpu-plot');"
            " return p && p.data && p.data.length >= 12; }",
            timeout=120_000,
        )
        page.evaluate(RECORD)
        # The restart is drawn and both ranks have a step-rate line of several points.
        page.wait_for_function(
            "() => { const p = document.querySelector('.nbtools-gpu-plot');"
            " if (!p || !p.data) return false;"
            " const ev = p.data[p.data.length - 1];"
            " return (ev.customdata || []).some((t) => t.startsWith('<b>restart</b>'))"
            " && p.data.filter((t) => /^rank \\d/.test(t.name) && t.x.length >= 3).length === 2; }",
            timeout=120_000,
        )
        time.sleep(1.0)  # a poll or two after the last report
        drawn = page.evaluate(AXES)
        panels = drawn["panels"]
        assert len(panels) == 4, panels  # utilization, memory, temperature, steps per second
        assert {p["type"] for p in panels} == {"date"}, panels
        bottom = panels[-1]["id"].replace("axis", "")
        assert all(p["matches"] == bottom for p in panels[:-1]), panels
        ranges = {tuple(round(v) for v in p["range"]) for p in panels}
        assert len(ranges) == 1, panels  # curves that start together start at one place
        # The restart's line crosses every panel where that panel's axis puts its time.
        for panel in panels:
            middle = (panel["top"] + panel["bottom"]) / 2
            crossing = [ln for ln in drawn["lines"] if ln["top"] <= middle <= ln["bottom"]]
            assert crossing, (panel, drawn["lines"])
            assert min(abs(ln["x"] - panel["at"]) for ln in crossing) < 1.5, (panel, crossing)
        # Every drawing on the way had every panel on a date axis (an event drawn after
        # the last rebuild once turned the first into a linear one), and plotly never
        # unmatched an axis (it says so when it does).
        states = page.evaluate("() => { clearInterval(window.__recording); return window.__axes; }")
        assert states and all(":linear" not in state for state in states), states
        assert not [m for m in console if "ignored" in m], console  # "ignored xaxis.matches"
        # Without a GPU, the pane says how to try it with simulated ones.
        status = page.locator(".nbtools-gpu-status").nth(1)
        status.wait_for(timeout=60_000)
        assert status.get_attribute("data-status") == "unavailable"
        text = status.inner_text()
        assert "%gpu_pane --simulated 4" in text and "GPUPane(simulated=4)" in text, text
