"""The documentation site: pages free of raw role text, notebooks shown with all their outputs.

The checks live in the site's own Sphinx extension (``docs/_ext/nbtools_docs.py``), where every
page is checked as it is written and a problem is a warning, so an error of ``sphinx -W``. The
fast tests feed the checks pages of the kind they must catch; the slow one builds the site as CI
does and looks at what it wrote.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import nbtools_docs  # noqa: E402

# What a guide showed for {doc}`07_interactive_ranks.ipynb <...>` written with one backquote too many.
RAW_ROLE = (
    '<p>Notebook {doc}``07_interactive_ranks.ipynb<code class="docutils literal notranslate">'
    '<span class="pre">&lt;../notebooks/07_interactive_ranks&gt;</span></code> trains</p>'
)


def test_a_role_left_as_text_is_found():
    assert nbtools_docs.unresolved_roles(RAW_ROLE) == ["{doc}``07_interactive_ranks.ipynb` trains"]
    assert nbtools_docs.unresolved_roles("<p>see {py:func}`nbtools.distributed`</p>")


def test_roles_inside_code_and_braces_in_prose_are_not_flagged():
    page = (
        "<p>Write <code>{doc}`page`</code> for a link; a dict {rank: loss} is fine.</p>"
        '<div class="highlight"><pre>f"{rank}`"  # {doc}`x`</pre></div>'
        '<p><a class="reference internal" href="x.html">a resolved link</a></p>'
    )
    assert nbtools_docs.unresolved_roles(page) == []


def _notebook(*cells):
    return {"cells": [{"cell_type": "code", **cell} for cell in cells]}


def _output(*mimes, kind="display_data"):
    return {"output_type": kind, "data": {mime: "..." for mime in mimes}, "metadata": {}}


def _page(*outputs):
    return "".join(f'<div class="cell_output docutils container">{out}</div>' for out in outputs)


SHOWN = '<div class="output text_plain highlight-myst-ansi notranslate"><pre>1</pre></div>'
IMAGE = '<img alt="chart" src="../_images/a.png" />'


def test_a_notebook_that_never_ran_is_reported():
    notebook = _notebook(
        {"execution_count": None, "outputs": []}, {"execution_count": None, "outputs": []}
    )
    (problem,) = nbtools_docs.notebook_problems(notebook, "<p>no outputs</p>")
    assert "code cells 1, 2 never ran" in problem and "run_notebooks.py" in problem


def test_an_output_the_page_dropped_is_reported():
    plotly = _output("application/vnd.plotly.v1+json")  # saved without its PNG rendering
    notebook = _notebook(
        {"execution_count": 1, "outputs": [_output("text/plain")]},
        {"execution_count": 2, "outputs": [plotly]},
    )
    (problem,) = nbtools_docs.notebook_problems(notebook, _page(SHOWN))
    assert "shows 1 of the 2 outputs" in problem


def test_a_notebook_shown_whole_passes():
    notebook = _notebook(
        {"execution_count": 1, "outputs": [_output("text/plain")]},
        {"execution_count": 2, "outputs": [_output("application/vnd.plotly.v1+json", "image/png")]},
        {"execution_count": 3, "outputs": []},
    )
    assert nbtools_docs.notebook_problems(notebook, _page(SHOWN, IMAGE)) == []


def test_a_plotly_figure_shows_as_its_png_and_one_without_stays_to_be_reported():
    plotly = "application/vnd.plotly.v1+json"
    with_png = _output(plotly, "image/png")
    alone = _output(plotly)
    notebook = _notebook({"execution_count": 1, "outputs": [with_png, alone]})
    assert nbtools_docs.drop_rendered_plotly(notebook)
    assert set(with_png["data"]) == {"image/png"} and set(alone["data"]) == {plotly}
    assert not nbtools_docs.drop_rendered_plotly(notebook)


def test_the_settings_table_renders_every_user_setting():
    from nbtools._internal.settings import SETTINGS

    text = "\n".join(nbtools_docs.settings_table())
    assert all(f"`{s.name}`" in text for s in SETTINGS if not s.internal)


def test_the_cli_reference_lists_every_subcommand():
    lines = "\n".join(nbtools_docs.cli_reference())
    assert "`nbtools doctor`" in lines and "`nbtools demo`" in lines and "`--json`" in lines


def test_a_magic_option_without_help_needs_a_meaning_on_the_page():
    start = nbtools_docs.magic_parsers("distributed")["start"]
    assert "--gpus" in nbtools_docs.unexplained(start, {})
    meanings = nbtools_docs.parse_meanings(
        ["--gpus: one rank per GPU", "--hang-timeout: seconds without", "  progress"]
    )
    assert meanings["--hang-timeout"] == "seconds without progress"
    assert "--gpus" not in nbtools_docs.unexplained(start, meanings)
    table = "\n".join(nbtools_docs.options_table(start, meanings))
    assert "| `--gpus N` |  | one rank per GPU |" in table


def test_a_magics_usage_is_written_as_a_user_types_it():
    def usage(name):
        lines = nbtools_docs.magic_reference(name)
        return lines[lines.index("```text") + 1]

    assert usage("autoresume").startswith("%%autoresume [--every N]")
    assert usage("gpu_pane").startswith("%gpu_pane [--interval S]")
    assert usage("distributed").startswith("%distributed start [--processes")


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_example_notebook_is_saved_run_with_a_png_beside_each_chart(path):
    notebook = json.loads(path.read_text(encoding="utf-8"))
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    unrun = [i for i, cell in enumerate(code, 1) if cell.get("execution_count") is None]
    assert not unrun, (
        f"code cells {unrun} never ran: python docs/_tools/run_notebooks.py {path.name}"
    )
    assert any(cell.get("outputs") for cell in code)
    for cell in code:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            assert "application/vnd.plotly.v1+json" not in data or "image/png" in data
            text = "".join(data.get("text/plain", ""))
            assert not (text.startswith("<Figure size") and len(data) == 1), (
                f"{path.name}: a matplotlib figure saved as its repr (a non-inline backend)"
            )
    assert "widgets" not in notebook["metadata"], "widget state makes the page load a CDN"


@pytest.mark.slow
def test_the_site_builds_with_no_warning_and_shows_every_notebook(tmp_path):
    out = tmp_path / "html"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = (out / "notebooks" / f"{notebook.stem}.html").read_text(encoding="utf-8")
        saved = json.loads(notebook.read_text(encoding="utf-8"))
        assert nbtools_docs.rendered_outputs(page) > 0, f"{notebook.name} shows no output"
        assert nbtools_docs.notebook_problems(saved, page) == []
    front = (out / "index.html").read_text(encoding="utf-8")
    assert front.count("<img") >= 2, "the front page shows the recovery figure and the pane"
    assert "copybutton" in (out / "_static").joinpath("copybutton.js").read_text(encoding="utf-8")
    assert os.path.exists(out / "troubleshooting.html") and os.path.exists(
        out / "reference" / "configuration.html"
    )
