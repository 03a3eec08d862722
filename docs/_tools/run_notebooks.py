"""Run the example notebooks and save them with their outputs, as the documentation shows them.

    python docs/_tools/run_notebooks.py                     # every notebook in notebooks/
    python docs/_tools/run_notebooks.py notebooks/02_*.ipynb

Each notebook runs top to bottom in a fresh ``python3`` kernel whose working directory is
``notebooks/`` (as under ``pytest --nbmake``), on whatever the machine has: the saved outputs of
the site come from CPU ranks. Every plotly figure gets a PNG rendering beside its JSON (with
kaleido, which drives the system's Chromium: ``pip install kaleido``), so that a page without a
kernel still shows the chart. Widget state is not kept: the GPU pane leaves a still picture in
its output, and a page with widget state would load the widgets' JavaScript from a CDN. The
per-cell timestamps nbclient records are dropped: they would change every file on every run.
A notebook that leaves a file in ``notebooks/`` (ignored by git or not) is an error.
"""

from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import subprocess
import sys
import time
from datetime import datetime

import nbformat
from nbclient import NotebookClient
from nbconvert.preprocessors import CoalesceStreamsPreprocessor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLOTLY = "application/vnd.plotly.v1+json"


def _untracked() -> set[str]:
    """Files under notebooks/ that git does not track (ignored ones too): where a notebook's
    relative paths land."""
    out = subprocess.run(
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=all",
            "--ignored=matching",
            "--",
            "notebooks",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}


def _drop_empty(nb: nbformat.NotebookNode) -> None:
    """Remove outputs that show nothing: a widget's empty text once its view is gone."""
    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [
                output
                for output in cell.outputs
                if output.get("output_type") not in ("display_data", "execute_result")
                or any(
                    "".join(value) if isinstance(value, list) else value
                    for value in output.get("data", {}).values()
                )
            ]


def _png_fallbacks(nb: nbformat.NotebookNode) -> int:
    """Add an ``image/png`` rendering to every plotly output that has none; return how many."""
    import plotly.io as pio  # noqa: TID251 (a documentation tool, not the package)

    added = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY in data and "image/png" not in data:
                fig = pio.from_json(json.dumps(data[PLOTLY]), skip_invalid=True)
                height = fig.layout.height or 450
                png = pio.to_image(fig, format="png", width=900, height=height, scale=1.5)
                data["image/png"] = base64.b64encode(png).decode("ascii")
                added += 1
    return added


def run(path: str, timeout: int) -> None:
    """Execute the notebook at ``path`` in place, with PNG fallbacks for its plotly figures."""
    nb = nbformat.read(path, as_version=4)
    before = _untracked()
    start = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
        store_widget_state=False,
        record_timing=True,
    )
    client.execute()
    elapsed = time.perf_counter() - start
    timings = []
    for index, cell in enumerate(nb.cells):
        stamps = cell.get("metadata", {}).pop("execution", None)
        if stamps and "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            t0 = datetime.fromisoformat(stamps["iopub.execute_input"].replace("Z", "+00:00"))
            t1 = datetime.fromisoformat(stamps["shell.execute_reply"].replace("Z", "+00:00"))
            timings.append((index, (t1 - t0).total_seconds()))
    nb.metadata.pop("widgets", None)
    # What a notebook front end shows: consecutive prints as one output, a progress bar
    # redrawn with carriage returns as its last state.
    CoalesceStreamsPreprocessor().preprocess(nb, {})
    _drop_empty(nb)
    added = _png_fallbacks(nb)
    nbformat.write(nb, path)
    left = sorted(_untracked() - before - {os.path.relpath(path, ROOT)})
    slowest = ", ".join(f"cell {i}: {s:.1f} s" for i, s in sorted(timings, key=lambda t: -t[1])[:3])
    print(
        f"{os.path.relpath(path, ROOT)}: {elapsed:.1f} s ({slowest}); {added} PNG fallback(s)",
        flush=True,
    )
    if left:
        raise SystemExit(
            f"{path} left files in notebooks/: {', '.join(left)}; remove them in its last cell"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "notebooks", nargs="*", help="notebooks to run (default: notebooks/*.ipynb)"
    )
    parser.add_argument(
        "--timeout", type=int, default=600, help="seconds a cell may run (default 600)"
    )
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    for path in paths:
        run(path, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
