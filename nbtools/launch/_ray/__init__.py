"""Ranks on a Ray cluster: one actor per rank in a placement group.

Imported only for ``cluster="ray"``; ``import nbtools`` never imports Ray.
"""

from __future__ import annotations

from nbtools.launch._ray._backend import RayBackend, RayGroup

__all__ = ["RayBackend", "RayGroup"]
