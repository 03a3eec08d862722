"""Rich output from ranks: ``display()``, matplotlib figures and pandas tables reach the cell.

In the kernel, ``display(df)`` shows an HTML table and ``plt.show()`` a PNG. A
rank has no kernel: IPython's ``display`` would print the text form, and
matplotlib would draw nowhere. So in rank 0 (the rank whose output a cell
shows as the run's own), nbtools

- replaces IPython's ``display`` (when user code imports it) with one that
  formats each object as IPython does (its MIME bundle: HTML, PNG, Markdown,
  with the plain-text fallback), and
- makes matplotlib's default backend one whose ``show()`` renders each open
  figure as PNG (:mod:`nbtools.launch._rank._display_mpl`), unless the user chose a
  backend;

the other ranks' rich output is dropped, as one cell shows one figure, not
one per rank (their text output is kept), unless the launch asked for
``rich_output="all"``: then every rank's reaches the cell, each labelled
``[rank N]``, rank 0's included.
Each bundle is written to a file in the launch's private directory and a
marker line on the rank's stdout names it (:func:`publish`), so the kernel's
output forwarder shows it in the cell in order with the text around it
(:func:`show`), through the kernel's own ``display``. Outside a kernel the
text fallback is printed.
"""

from __future__ import annotations

import base64
import importlib
import itertools
import json
import os
import sys
import types
from typing import Any

from nbtools._internal import hooks

__all__ = [
    "ENV",
    "MARK",
    "RICH_OUTPUT_MODES",
    "environment",
    "install",
    "publish",
    "show",
    "mime_bundle",
    "figure_bundle",
    "reaches_cell",
    "shown",
]

#: Carries the directory for bundles to rank 0 (JSON); set only when the caller is a kernel.
ENV = "NBTOOLS_RICH_OUTPUT"
#: Starts the stdout line that names a bundle file; the line ends with BEL.
MARK = "\x1b]nbtools-display;"
_DISPLAY_MODULE = "IPython.core.display_functions"
_BACKEND = "module://nbtools.launch._rank._display_mpl"
_state: dict[str, Any] = {}
_numbers = itertools.count()


#: ``rank0``: rank 0's rich output reaches the cell, the other ranks' is dropped; ``all``:
#: every rank's, each labelled by its rank; ``none``: text only.
RICH_OUTPUT_MODES = ("rank0", "all", "none")


def environment(directory: str, ranks: str = "rank0") -> dict[str, str]:
    """``{ENV: ...}`` when the caller is an IPython kernel that can show rich output, else ``{}``.

    Args:
        directory: the launch's private directory, where ranks leave their bundles.
        ranks: one of :data:`RICH_OUTPUT_MODES`.
    """
    if ranks == "none":
        return {}
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if callable(get) else None
    if shell is None or not hasattr(shell, "kernel"):
        return {}  # a terminal or a script: text is all there is
    return {ENV: json.dumps({"dir": directory, "ranks": ranks})}


def install() -> None:
    """In a rank: send rich output to the cell (rank 0 only; see the module docstring)."""
    text = os.environ.get(ENV)
    if not text:
        return
    try:
        config = json.loads(text)
        directory, ranks = config["dir"], config.get("ranks", "rank0")
    except (ValueError, KeyError, TypeError):
        return
    if ranks != "all" and os.environ.get("RANK", "0") != "0":
        _state["drop"] = True  # the cell shows rank 0's rich output, not N copies of it
    elif os.path.isdir(directory):
        _state["dir"] = directory
        _state["labelled"] = ranks == "all"  # every rank's reaches the cell: say whose
    else:
        return  # rank 0 on another machine: text only
    if "MPLBACKEND" not in os.environ and "matplotlib.pyplot" not in sys.modules:
        os.environ["MPLBACKEND"] = _BACKEND
    # Before ``IPython.display`` takes the name from its module (or now, if it already did).
    hooks.after_import(_DISPLAY_MODULE, _replace_display)


def shown() -> bool:
    """Whether this rank's rich output reaches the cell (False on ranks other than 0)."""
    return not _state.get("drop")


def reaches_cell() -> bool:
    """Whether this rank's rich output goes to a kernel's cell (else: text only)."""
    return _state.get("dir") is not None


def figure_bundle(obj: Any) -> dict[str, Any] | None:
    """A matplotlib figure as the kernel's displayhook shows it; else None.

    PNG with the text fallback where this rank's rich output reaches the cell
    (:func:`reaches_cell`), else the text alone. The figure is closed either way,
    as the inline backend closes a cell's figures once the cell ran.
    """
    if not _is_figure(obj):
        return None
    text = repr(obj)
    png = _as_png(obj) if reaches_cell() else None
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(obj)
    return {"text/plain": text} if png is None else {"image/png": png, "text/plain": text}


def publish(bundle: dict[str, Any]) -> None:
    """Send one MIME bundle to the cell (rank side)."""
    if _state.get("drop"):
        return
    directory = _state.get("dir")
    if directory is None:
        print(bundle.get("text/plain", ""), flush=True)
        return
    path = os.path.join(directory, f"display-{os.getpid()}-{next(_numbers)}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"bundle": bundle, "labelled": bool(_state.get("labelled"))}, fh)
    os.replace(tmp, path)
    sys.stdout.flush()  # what was printed before stays before
    sys.stdout.write(f"{MARK}{path}\x07\n")
    sys.stdout.flush()


def show(line: str, rank: int) -> str | None:
    """In the kernel: show the bundle a marker line names; the text to print instead, if any."""
    path = line[line.index(MARK) + len(MARK) :].split("\x07", 1)[0]
    try:
        with open(path, encoding="utf-8") as fh:
            sent = json.load(fh)
        os.unlink(path)
        bundle, labelled = sent["bundle"], sent["labelled"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ipython = sys.modules.get("IPython")
    display = getattr(getattr(ipython, "display", None), "display", None)
    if display is None or not isinstance(bundle, dict):
        return str(bundle.get("text/plain", "")) if isinstance(bundle, dict) else None
    if labelled:
        print(f"[rank {rank}]", file=sys.stdout, flush=True)  # rich_output="all": whose it is
    display(bundle, raw=True)
    return None


def mime_bundle(obj: Any, include: Any = None, exclude: Any = None) -> dict[str, Any]:
    """``obj`` as IPython would display it: its MIME bundle (a figure as PNG), JSON-ready."""
    figure = _as_png(obj)
    if figure is not None:
        return {"image/png": figure, "text/plain": repr(obj)}
    # Imported here, in a rank whose user code already imported IPython's display.
    formatters = importlib.import_module("IPython.core.formatters")
    formatter = _state.get("formatter")
    if formatter is None:
        formatter = _state["formatter"] = formatters.DisplayFormatter()
    data, _ = formatter.format(obj, include=include, exclude=exclude)
    return {key: _jsonable(value) for key, value in data.items()}


def _is_figure(obj: Any) -> bool:
    figure_type = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
    return figure_type is not None and isinstance(obj, figure_type)


def _as_png(obj: Any) -> str | None:
    if not _is_figure(obj):
        return None
    import io

    buffer = io.BytesIO()
    obj.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")  # images, as Jupyter carries them
    return value


def _display(
    *objs: Any, include: Any = None, exclude: Any = None, raw: bool = False, **_: Any
) -> None:
    if _state.get("drop"):
        return
    for obj in objs:
        publish(dict(obj) if raw else mime_bundle(obj, include, exclude))


def _replace_display(module: types.ModuleType) -> None:
    if getattr(module.display, "_nbtools", False):
        return
    _display._nbtools = True  # type: ignore[attr-defined]
    _display.__doc__ = module.display.__doc__
    module.display = _display  # type: ignore[attr-defined]
    package = sys.modules.get("IPython.display")
    if package is not None:
        package.display = _display  # type: ignore[attr-defined]
