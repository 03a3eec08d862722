"""Cached volume data: keep GPUs fed from files on a slow mounted volume.

``VolumeDataset`` serves the files under a root (a directory, a mounted volume
or an fsspec URL) as paths of complete local copies; ``DataLoader`` is
PyTorch's loader with persistent workers and a position that resumes exactly.

Example:
    >>> from nbtools.data import VolumeDataset, DataLoader
    >>> files = VolumeDataset("/mnt/vol/images", "**/*.jpg", shuffle=True, seed=0)  # doctest: +SKIP
    >>> loader = DataLoader(Decode(files), batch_size=64, num_workers=4)  # doctest: +SKIP
    >>> loader.load_state_dict(saved)   # optional: resume mid-epoch   # doctest: +SKIP
    >>> for batch in loader: ...                                       # doctest: +SKIP

Rules users must follow:

* **Use a yielded path while it is current.** When free space on the cache
  filesystem falls below the threshold (10 % of it by default;
  ``min_free_bytes``, ``NBTOOLS_CACHE_MIN_FREE_BYTES`` or
  ``SGC_FSLAYER_MIN_FREE_DISK_BYTES``), files are evicted, oldest download
  first. Protected are the copies not yet served, the path yielded last, and,
  when an nbtools ``DataLoader`` puts the paths themselves into its batches
  (a bare ``VolumeDataset``, or a wrapper that yields paths), every path of
  the batches the loader may still hold: its prefetched batches and the one
  the loop is using. Such a loader lowers ``prefetch_factor`` when the cache
  cannot hold that many files, and says so. Open, decode or copy each path in
  the step that receives it; do not keep paths in lists for later. PyTorch's
  own loader gives no such protection: decode in its workers.
* **Wrap, do not read ahead.** Decode in an ``IterableDataset`` that keeps the
  ``VolumeDataset`` as an attribute (or forwards ``state_dict`` /
  ``load_state_dict`` to it) and yields one sample per path as it arrives.
  Paths a wrapper has taken but not yet yielded (a shuffle buffer) count as
  seen.
* **Same ``num_workers`` on every rank.** Files are split with a global stride
  over ``world_size x num_workers`` slots; a mismatch is an error at the start
  of iteration. No ``DistributedSampler`` is needed.
* **Same global batch on every rank.** With ``DataLoader(global_batch_size=N)``
  each step takes ``N`` samples over all ranks, each rank its
  ``nbtools.runtime.batch_plan`` share; ranks that disagree on ``N`` are refused
  at the start of iteration.
* **Save and restore on every rank.** With a process group of several ranks,
  ``state_dict()`` is a collective; each rank gets the same plain-Python state.

Resume semantics: the saved position counts only what the training loop
received. Restoring it (with any world size or ``num_workers``) serves every
remaining file of the epoch exactly once, then the following epochs in the
same order as an uninterrupted run (the order is a function of ``(seed,
epoch)``). With the same world size and ``num_workers`` the rest of the
epoch also comes in the same batch order; with another layout, or near the end
of an epoch where one worker ran out before the others, the set is the same
but the order within the rest of that epoch may differ. Iterating again after
an interrupted loop continues the epoch; a finished epoch is followed by the
next; ``set_epoch(n)`` picks an epoch explicitly (the epoch held keeps its
position, which is how a resumed run continues).

The cache directory is shared by every worker and rank on a node, and private
to its user: ``$NBTOOLS_CACHE_DIR``, ``$XDG_CACHE_HOME/nbtools`` or
``~/.cache/nbtools`` by default, created with mode 0700; a cache directory that
another user owns or can write to is refused. Copies land under a temporary
name and are renamed when complete; ``fcntl.flock`` locks keep two processes
from copying a file at the same time and keep files in use from being
evicted (one shared lock for a whole stream while nothing needs evicting, one
per file otherwise). A cache too small for ``prefetch`` files per stream
copies fewer ahead (at least one), with a warning. Nothing lives in
``/dev/shm``, so an interrupted notebook leaves no stale segment behind; the
temporary files of a killed copy are removed by the next eviction, or by a
process that opens the cache (one every ten minutes per node at most: the walk
costs time per cached file).

The file list is one index per dataset, a memory-mapped file in the cache
directory (``.index/``) that one process per node builds (the others wait
for it) and every rank and loader worker shares; a later launch reuses it
when no listed directory changed. That check sees files added, removed or
renamed onto a name; a file rewritten in place is seen when it is served
(``check_sources``: once per launch by default, or every epoch). Mounts whose
directory times do not change or are cached need ``refresh=True``. A copy is kept only when it holds the whole source, as
listed and unchanged while read; else it is copied again or refused.

Loader workers are started by PyTorch's default method (``fork`` on Linux),
which lets classes defined in notebook cells run in them. Forking after CUDA is
initialised in the kernel is safe as long as the workers do not use CUDA; keep
GPU work in the training loop.

Layout, for readers of the code: three rooms named after their mechanism,
``_listing`` (where the list of files comes from: listing, mapped index, the
index kept in the root and its lease), ``_cache`` (where copies live: the
node's file cache, eviction gate, pins, guard, sweep, cache location) and
``_stream`` (how a stream serves them: stream, spec, freshness check, items,
tags), each importing only the ones before it. Around them sit
``dataset.py`` and ``loader.py`` (which also spots input stalls), the positions
of an epoch (``_positions``), the plan of one iteration (``_plan``) and the
loader's declared link to a dataset (``_dataset_link``). Start reading at
``VolumeDataset.__iter__`` in ``dataset.py``.
"""

from __future__ import annotations

from nbtools.data.dataset import VolumeDataset
from nbtools.data.loader import DataLoader

__all__ = ["VolumeDataset", "DataLoader"]
