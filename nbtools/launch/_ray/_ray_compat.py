"""Every use of a private Ray name, in one place (as ``nbtools/_torch_compat.py`` is for torch).

Ray may rename or drop a private name in any release. Each one nbtools uses is
reached only through a function here that falls back to public behaviour when
the name is gone; ``tests/ray/test_ray_compat.py`` has one test per name.

Names and what stands in for them:

- ``ray._private.worker.global_worker.node.get_session_dir_path()`` (this
  node's session directory, where a killed actor's leftovers stay inside
  Ray's own cleanup): ``None``, and callers use the plain temporary directory.
"""

from __future__ import annotations

import os

__all__ = ["session_dir"]


def session_dir() -> str | None:
    """Ray's session directory on this node, or ``None`` where Ray does not say."""
    try:
        import ray._private.worker as worker

        path = worker.global_worker.node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - a renamed or missing private name: no session dir
        return None
    return path if path and os.path.isdir(path) else None
