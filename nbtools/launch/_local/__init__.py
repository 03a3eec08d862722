"""The local backend: ranks as processes on this machine, from a forkserver, under torch elastic.

- ``_backend``: :class:`LocalBackend` and :class:`LocalGroup`, what the runner
  and the pool drive (start a group, poll it, stop it, read its failures);
- ``_elastic``: torch elastic's ``MultiprocessContext`` started quietly, its
  exit statuses read, an attempt's failure told from them and the ranks' records;
- ``_mend`` (with ``_heal`` and ``_grow``): healing and shrinking a group in
  place, and growing it back;
- ``_forkserver`` (with ``_forkserver_ready``): the forkserver's own side,
  preloaded first, and what it ends when the caller is gone.

What runs in each rank is in :mod:`nbtools.launch._rank`; the machine's
environment and the forkserver's preloads in :mod:`nbtools.launch._env`.
Start reading at ``_backend.LocalBackend.start``.

The door loads ``_backend`` (and torch with it) on first use: the forkserver
imports ``_forkserver`` first, before torch, so that it settles at once
(see there), and a first call can start its ranks without waiting for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbtools.launch._local._backend import LocalBackend, LocalGroup

__all__ = ["LocalBackend", "LocalGroup"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from nbtools.launch._local import _backend

        return getattr(_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
