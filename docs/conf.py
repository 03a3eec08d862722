"""Sphinx configuration of the nbtools documentation (``python -m sphinx -W -b html docs docs/_build/html``).

The build needs no network: the example notebooks are rendered from their saved outputs
(never executed), and intersphinx links to other projects' documentation use the inventories
found in ``docs/_inventories/`` (``<name>.inv``); a project without one is left out, without
a warning, and its names render as plain code. The site's own extension (``_ext/nbtools_docs.py``)
generates the configuration reference and fails the build on a role shown as text, a notebook
saved without its outputs and an output its page drops.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "_ext"))

import nbtools  # noqa: E402

project = "nbtools"
author = "nbtools maintainers"
copyright = "nbtools maintainers"
release = nbtools.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_nb",  # Markdown pages (MyST) and .ipynb notebooks with their saved outputs
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.intersphinx",
    "sphinx_copybutton",  # a copy button on every code block (prompts and outputs left out)
    "nbtools_docs",  # generated reference tables; checks of every built page (_ext/)
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}
exclude_patterns = [
    "_build",
    "_inventories",
    "_ext",
    "_tools",
    "notebooks/.ipynb_checkpoints",
    "**/mlflow.db*",
]
root_doc = "index"

# Notebooks are documents of their saved outputs: executing them needs ranks, kernels, a cluster.
nb_execution_mode = "off"
nb_output_stderr = "show"
# Notebook cells hold IPython magics (%load_ext, %distributed) that the Python lexer does not
# know; Pygments renders them in its relaxed mode, which is what is wanted.
# An output none of whose types the site renders is a warning (mystnb.unknown_mime_type):
# docs/_tools/run_notebooks.py saves a PNG beside every plotly chart, and the site's extension
# (_ext/nbtools_docs.py) leaves the chart's JSON out of a page where that PNG is there.
suppress_warnings = ["misc.highlighting_failure"]
# Widget views need a live kernel's state; a page shows the still picture saved beside them.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The API reference documents the public names only, each listed by name in api.rst.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Other projects' inventories, when vendored (docs/_inventories/<name>.inv); none are fetched.
_INVENTORIES = {
    "python": "https://docs.python.org/3",
    "torch": "https://docs.pytorch.org/docs/stable",
    "fsspec": "https://filesystem-spec.readthedocs.io/en/latest",
    "ray": "https://docs.ray.io/en/latest",
    "mlflow": "https://mlflow.org/docs/latest/api_reference",
}
intersphinx_mapping = {
    name: (url, os.path.join(HERE, "_inventories", f"{name}.inv"))
    for name, url in _INVENTORIES.items()
    if os.path.exists(os.path.join(HERE, "_inventories", f"{name}.inv"))
}
intersphinx_disabled_reftypes = ["*"]

# Furo: the whole table of contents in the sidebar, search, dark mode; code blocks and
# tables use the content's full width and scroll sideways rather than being cut.
# Nothing is fetched at build or view time.
html_theme = "furo"
html_title = f"nbtools {release}"
html_static_path = ["_static"]
html_css_files = ["nbtools.css"]
html_theme_options = {
    "source_repository": "https://github.com/nbtools-train/nbtools",
    "source_branch": "main",
    "source_directory": "docs/",
    "navigation_with_keys": False,
}
# Copy buttons copy the code only: no ">>> ", "$ " prompts, no "In [1]:".
copybutton_prompt_text = r">>> |\.\.\. |\$ |In \[\d*\]: "
copybutton_prompt_is_regexp = True
copybutton_exclude = ".linenos, .gp, .go"

# A broken cross-reference to an nbtools name is an error. Other projects' names resolve only
# through vendored inventories, private nbtools names are never documented, and the public
# names below are documented in their modules' docstrings, not on this site: all of these
# render as plain code.
_UNDOCUMENTED = [
    r"nbtools\.monitor\.NVMLBackend",
    r"nbtools\.monitor\.snapshot\.Snapshot",
    r"nbtools\.monitor\.timing",
]
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!nbtools\b).*"),
    (r"py:.*", r"nbtools\.(.*\.)?_.*"),
    *((r"py:.*", name) for name in _UNDOCUMENTED),
]
