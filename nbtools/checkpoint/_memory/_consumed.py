"""A rank's own slot restored in place: the optimizer state lives on in its pages.

Restoring a rank's own snapshot copies nothing it need not copy: the slot file
is mapped (shared, writable), checked against its checksum, the model's tensors
are copied into the model, and the optimizer state is loaded as tensors over
the mapped pages themselves (no new memory to fault in, no second copy). The
file stays a valid slot, unchanged, until the first optimizer step would
write into it: a step pre-hook then unlinks it (the mapping keeps its pages)
and a short background thread frees the pages of the tensors that were copied
out (tens of milliseconds per 100 MB that the first step does not wait for). A rank that dies
before that step still finds the slot whole; the next snapshot of the tier
unlinks it first too, so a reused slot file never shares pages with live state.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Consumed", "holes", "holds", "private"]

_PAGE = mmap.PAGESIZE


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _span(mm: mmap.mmap) -> tuple[int, int]:
    """The addresses ``[base, end)`` of ``mm``."""
    base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    return base, base + len(mm)


def holds(mm: mmap.mmap, tensors: Any) -> bool:
    """Whether any tensor of ``tensors`` (nested containers) lives in ``mm``: an optimizer
    that moved or cast its state on load (to a GPU, to another dtype) keeps none there."""
    if not len(mm):
        return False
    base, end = _span(mm)
    return any(base <= t.data_ptr() < end for t in _tensors(tensors) if t.numel())


def holes(mm: mmap.mmap, copied: Any, live: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Page ranges ``(start, length)`` of ``mm`` that only the tensors of ``copied`` used.

    Empty when a ``live`` tensor (a model parameter or buffer) sits in the mapping:
    then its values were not copied out, and no page may be freed.
    """
    if not len(mm) or holds(mm, list(live)):
        return []
    base, _ = _span(mm)
    out = []
    for tensor in _tensors(copied):
        start = tensor.data_ptr() - base
        if not tensor.numel() or not 0 <= start < len(mm):
            continue
        stop = start + tensor.numel() * tensor.element_size()
        first, last = -(-start // _PAGE) * _PAGE, stop // _PAGE * _PAGE
        if last > first:
            out.append((first, last - first))
    return out


class Consumed:
    """The slot at ``path`` whose mapping ``mm`` the ``optimizers`` now keep their state in.

    Args:
        path: The slot file (still a valid slot until :meth:`release`).
        mm: Its shared mapping.
        free: Page ranges of ``mm`` freed at :meth:`release` (see :func:`holes`).
        optimizers: Each gets a step pre-hook that calls :meth:`release`.
    """

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        free: list[tuple[int, int]],
        optimizers: Iterable[torch.optim.Optimizer],
    ) -> None:
        self.path: str | None = path
        self._mm: mmap.mmap | None = mm
        self._free = free
        self._handles = [o.register_step_pre_hook(self._before_step) for o in optimizers]
        self._freer: threading.Thread | None = None

    def _before_step(self, *args: Any) -> None:
        self.release()

    def drop_hooks(self) -> None:
        """Stop watching the optimizers (the file stays as it is)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def release(self) -> None:
        """Unlink the file (from here the state may change); free the copied-out pages in
        the background (see :meth:`join`)."""
        self.drop_hooks()
        path, mm, self.path, self._mm = self.path, self._mm, None, None
        if path is None or mm is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if not self._free or getattr(mmap, "MADV_REMOVE", None) is None:
            return
        freer = threading.Thread(
            target=_free_pages, args=(mm, self._free), name="nbtools-free-restored-pages"
        )
        try:
            freer.start()
        except RuntimeError:  # no new thread (interpreter shutdown): free them here
            _free_pages(mm, self._free)
            return
        self._freer = freer

    def join(self) -> None:
        """Wait until the pages :meth:`release` frees are freed."""
        if self._freer is not None:
            self._freer.join()


def _free_pages(mm: mmap.mmap, ranges: list[tuple[int, int]]) -> None:
    """Give the pages of ``ranges`` of the shared mapping ``mm`` back to the system."""
    for start, length in ranges:
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_REMOVE, start, length)


def private(obj: Any, mms: Iterable[mmap.mmap]) -> Any:
    """``obj`` (nested containers) with each tensor that lives in one of ``mms`` (other
    ranks' slots, only read from) cloned into memory of its own."""
    spans = [_span(mm) for mm in mms if len(mm)]

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            inside = value.numel() and any(b <= value.data_ptr() < e for b, e in spans)
            return value.clone() if inside else value
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(obj) if spans else obj
