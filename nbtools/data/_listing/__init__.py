"""Where the list of files comes from: the listing, the mapped index, the copy in the root.

What it holds: :mod:`._volume` walks a dataset root (a directory, a mount or an
fsspec URL) and opens its files, refusing anything that is not a regular file;
:mod:`._index` writes and maps the index file (paths, sizes, mtimes, the
directories listed); :mod:`._catalog` decides, once per dataset and node,
whether the index in the cache is fresh or the root must be listed again, and
re-checks the directories written just before a listing; :mod:`._shared_index`
keeps a copy of the index in the root for other nodes and later jobs, and
:mod:`._lease` makes one node list while the others wait for its index.

What it uses: the cache's location and privacy checks (through the front door of
:mod:`nbtools.data._cache`), and nothing else of ``nbtools.data``, which enters through this
``__init__`` only.

Where to start reading: :func:`._catalog.load_index`, the one entry point the
dataset calls.
"""

from __future__ import annotations

from nbtools.data._listing._catalog import job_token, load_index, namespace
from nbtools.data._listing._index import Index, open_index
from nbtools.data._listing._volume import Opener

__all__ = ["Index", "Opener", "job_token", "load_index", "namespace", "open_index"]
