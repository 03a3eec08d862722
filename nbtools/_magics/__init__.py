"""Implementation of the IPython magics registered by ``nbtools.magics``."""

from __future__ import annotations

__all__: list[str] = []
