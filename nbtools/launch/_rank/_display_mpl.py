"""A matplotlib backend for rank 0: ``plt.show()`` sends each open figure to the cell as PNG.

Selected through ``MPLBACKEND`` by :func:`nbtools.launch._rank._display.install`
(never when the user chose a backend). Drawing is Agg's.
"""

from __future__ import annotations

from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backends.backend_agg import FigureCanvasAgg

from nbtools.launch._rank import _display

__all__ = ["FigureCanvas", "show"]

FigureCanvas = FigureCanvasAgg


def show(*args: Any, **kwargs: Any) -> None:
    """Send every open figure to the cell and close it, as the inline backend does."""
    if _display.shown():
        for manager in Gcf.get_all_fig_managers():
            _display.publish(_display.mime_bundle(manager.canvas.figure))
    Gcf.destroy_all()
