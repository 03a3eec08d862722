"""Run the demo's killed-and-recovered training and its uninterrupted reference; draw assets/recovery.png.

The figure is the plotly chart the demo writes to ``recovery.html``, rendered in
headless Chromium (Debian's ``/usr/bin/chromium`` through playwright) and
screenshotted. As the demo does, one warm-up epoch comes first, so neither run
pays the cold start. Prints one JSON line: the recovery as the run's events
measured it (seconds from the kill to the next step, steps trained again, the
tier restored from), the wall time of the recovered run against the
uninterrupted one (the baseline, same run), their ratio, and whether the final
parameters matched.

Usage: python benchmarks/render_recovery.py [--png assets/recovery.png] [--chromium PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def screenshot(html: str, png: str, chromium: str) -> None:
    """Render the plotly figure of ``html`` at twice its CSS size into ``png``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 960, "height": 500}, device_scale_factor=2)
            page.goto("file://" + os.path.abspath(html))
            page.wait_for_selector(".plotly-graph-div .main-svg", timeout=30_000)
            page.locator(".plotly-graph-div").first.screenshot(path=png)
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", default=os.path.join(ROOT, "assets", "recovery.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    from nbtools._demo import report, run_pair

    work = tempfile.mkdtemp(prefix="nbtools-render-")
    try:
        outcome = run_pair(os.path.join(work, "demo"), verbose=False, warm=True)
        html = os.path.join(work, "recovery.html")
        problems = report(outcome, html)
        if os.path.exists(args.chromium):
            screenshot(html, args.png, args.chromium)
            png = args.png
        else:
            print(f"no Chromium at {args.chromium}; PNG not written", file=sys.stderr)
            png = None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    recovery = outcome.recovery
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "world_size": outcome.world_size,
                "steps": outcome.steps,
                "restored_step": outcome.recovered_results[0]["restored_step"],
                "restored_tier": outcome.recovered_results[0]["restored_tier"],
                "kill_to_next_step_s": recovery and round(recovery.seconds, 2),
                "steps_trained_again": recovery and recovery.trained_again,
                "warmup_s": round(outcome.warmup_seconds or 0.0, 2),
                "recovered_s": round(outcome.recovered_seconds, 2),
                "uninterrupted_s_baseline": round(outcome.reference_seconds, 2),
                "ratio_recovered_over_uninterrupted": round(
                    outcome.recovered_seconds / outcome.reference_seconds, 2
                ),
                "params_equal": not any("parameters" in p for p in problems),
                "problems": problems,
                "png": png,
            }
        )
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
