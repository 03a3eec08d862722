"""Preloaded last by the forkserver: says that every preload is imported (see ``_forkserver``)."""

from __future__ import annotations

from nbtools.launch._local._forkserver import mark_ready

__all__: list[str] = []

mark_ready()
