"""A rank's own slot restored in place: the optimizer state starts out in its pages.

Restoring a rank's own snapshot copies nothing on the restore's path that it
need not copy: the slot file is mapped (shared), checked against its checksum,
the model's tensors are copied into the model, and the optimizer state is
loaded as tensors over the mapped pages themselves. Training then starts at
once, while a background thread copies those tensors into memory of their own.
The first optimizer step (or the tier's next snapshot, or its close) waits for
that copy and moves each tensor onto it (``Tensor.set_``: the optimizer keeps
the same tensor objects), before anything changes them.

Only what still lives in the slot's pages after the load keeps it mapped: an
optimizer whose parameters are on a GPU takes its moments there as it loads
them, and its 0-dim ``step`` tensors (kept on the CPU) get memory of their own
at once, so such a restore leaves no page of the slot mapped. What the objects
kept of other ranks' slots (read-only) is cloned before the restore ends; what
they took to a GPU is never cloned on the host.

So the slot file is never written: it stays a valid slot of the restored step
until a newer snapshot replaces it like any other. A rank that fails again
before its next snapshot is published (even during it) restores the same step,
never an older one: at most ``memory_every`` steps are trained again, however
often a job fails.
"""

from __future__ import annotations

import mmap
import threading
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from nbtools._internal.log import get_logger
from nbtools.checkpoint import _objects, _state
from nbtools.checkpoint._collective import gather
from nbtools.checkpoint._memory import _layout, _sharded
from nbtools.checkpoint._memory._choice import Fetched
from nbtools.checkpoint._restore import Offer, Restored
from nbtools.errors import CheckpointError

__all__ = ["Consumed", "Loaded", "holds", "load", "release_peers", "scalars", "within"]

_log = get_logger("checkpoint")


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """The plain tensors of ``obj`` (nested containers; a DTensor's local shard)."""
    if isinstance(obj, DTensor):
        yield obj._local_tensor
    elif isinstance(obj, torch.Tensor):
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


def within(mm: mmap.mmap, tensors: Any) -> list[torch.Tensor]:
    """The tensors of ``tensors`` (nested containers) whose data lives in ``mm``."""
    if not len(mm):
        return []
    base, end = _span(mm)
    return [t for t in _tensors(tensors) if t.numel() and base <= t.data_ptr() < end]


def holds(mm: mmap.mmap, tensors: Any) -> bool:
    """Whether any tensor of ``tensors`` (nested containers) lives in ``mm``: an optimizer
    that moved or cast its state on load (to a GPU, to another dtype) keeps none there."""
    return bool(within(mm, tensors))


class Consumed:
    """The slot at ``path`` whose mapping ``mm`` the ``tensors`` (the restored optimizer
    state, and any live model tensor) still live in.

    Args:
        path: The slot file (a valid slot, never written here).
        mm: Its shared mapping.
        tensors: The tensors in ``mm``; each moves to memory of its own at :meth:`release`.
        optimizers: Each gets a step pre-hook that calls :meth:`release`.
    """

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        tensors: list[torch.Tensor],
        optimizers: Iterable[torch.optim.Optimizer],
    ) -> None:
        self.path: str | None = path
        self._mm: mmap.mmap | None = mm
        self._tensors = tensors
        self._copies: list[torch.Tensor] = []
        self._copier: threading.Thread | None = threading.Thread(
            target=self._copy, name="nbtools-copy-restored-state"
        )
        try:
            self._copier.start()
        except RuntimeError:  # no new thread (interpreter shutdown): copy at release
            self._copier = None
        self._handles = [o.register_step_pre_hook(self._before_step) for o in optimizers]

    def _copy(self) -> None:
        try:
            with torch.no_grad():
                self._copies = [t.clone() for t in self._tensors]
        except BaseException:  # noqa: BLE001 - release() copies again, and raises there
            self._copies = []

    def _before_step(self, *args: Any) -> None:
        self.release()

    def drop_hooks(self) -> None:
        """Stop watching the optimizers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def release(self) -> None:
        """Wait for the copy and move every tensor onto it; from here nothing lives in the
        slot's pages (the slot stays as it is, a valid slot)."""
        self.drop_hooks()
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.join()
        tensors, self._tensors = self._tensors, []
        if not tensors:
            return
        copies, self._copies = self._copies, []
        if len(copies) != len(tensors):  # the thread failed or never ran: copy here
            with torch.no_grad():
                copies = [t.clone() for t in tensors]
        with torch.no_grad():
            for tensor, copy in zip(tensors, copies, strict=True):
                tensor.set_(
                    copy.untyped_storage(), copy.storage_offset(), copy.shape, copy.stride()
                )
        self.path, self._mm = None, None

    def join(self) -> None:
        """Wait for the background copy (it is :meth:`release` that uses it)."""
        if self._copier is not None:
            self._copier.join()


def _move(tensors: Iterable[torch.Tensor]) -> None:
    """Move each tensor onto a copy of its own (the same tensor objects: ``Tensor.set_``)."""
    with torch.no_grad():
        for tensor in tensors:
            copy = tensor.clone()
            tensor.set_(copy.untyped_storage(), copy.storage_offset(), copy.shape, copy.stride())


def scalars(mm: mmap.mmap, tensors: Any) -> list[torch.Tensor]:
    """Move the 0-dim tensors of ``tensors`` (nested containers) that live in ``mm`` onto
    memory of their own, at once; the other tensors that live there.

    An optimizer whose parameters are on a GPU takes its moments there when it loads, but
    keeps its 0-dim ``step`` tensors on the CPU (unless fused or capturable): those few
    bytes must not keep a whole slot mapped."""
    inside = within(mm, tensors)
    _move(t for t in inside if t.dim() == 0)
    return [t for t in inside if t.dim() != 0]


def release_peers(mms: Iterable[mmap.mmap], tensors: Any) -> int:
    """Move each tensor of ``tensors`` (nested containers) that lives in one of ``mms``
    (other ranks' slots, only read from) onto memory of its own; how many moved.

    Run after the objects loaded their state: what an optimizer took to its device (a
    GPU) is not in ``mms`` any more and is never copied on the host."""
    moved = 0
    for mm in mms:
        inside = within(mm, tensors)
        _move(inside)
        moved += len(inside)
    return moved


# --- the restore ----------------------------------------------------------------


class Loaded(NamedTuple):
    """What :func:`load` put into the objects, and this rank's own slot whose pages the
    restored optimizer state lives in (None: none), for the tier to keep."""

    restored: Restored
    consumed: Consumed | None


def _check_fits(kinds: _objects.Objects, state: dict[str, Any], where: str) -> None:
    for name, model in kinds.models.items():
        if set(state.get(name) or {}) != set(get_model_state_dict(model)):
            raise CheckpointError(f"{where} holds other parameters for {name!r}")
    for name in kinds.optimizers:
        if name not in state:
            raise CheckpointError(f"{where} holds no optimizer {name!r}")


def load(
    rank: int, pg: dist.ProcessGroup | None, offer: Offer, kinds: _objects.Objects
) -> Loaded | None:
    """Put the slots ``offer`` holds (see ``_choice``) into the objects on every rank (a
    collective); None (the objects unchanged, after one line saying why) when some rank
    cannot. This rank's own slot, restored in place, is the answer's ``consumed``."""
    step, got = offer.step, offer.held
    assert step is not None and isinstance(got, Fetched)
    where = f"the memory snapshot of step {step} of rank {rank}"
    state: dict[str, Any] = {}
    blob: dict[str, Any] = {}
    error = ""
    try:
        with warnings.catch_warnings():  # peers' slots are mapped read-only: only read
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            peers = {o: _layout.decode(*b) for o, b in got.bodies.items() if o != rank}
        state = _layout.fill(_layout.decode(*got.bodies[rank]), peers, where)
        state = _sharded.unflatten(state, _sharded.meshes(kinds.models.values()), where)
        _check_fits(kinds, state, where)
        blob = _state.decode_blob({_state.NS: state[_state.NS]}, kinds, where)
    except Exception as exc:  # noqa: BLE001 - every rank must learn it, then use the volume
        error = f"{type(exc).__name__}: {exc}"
    errors = gather(pg, error)
    if any(errors):
        first = next(e for e in errors if e)
        _log.warning("not restoring step %d from memory (%s); using the volume", step, first)
        return None
    _state.apply_state(kinds, state, blob)
    del state
    optimizers = [o for o, _ in kinds.optimizers.values()]
    live = [t for m in kinds.models.values() for t in [*m.parameters(), *m.buffers()]]
    loaded = [[o.state for o in optimizers], live]
    # What the objects kept of peers' slots gets memory of its own now; what they took to
    # another device (a GPU) was never copied on the host.
    release_peers([mm for _, mm, _ in got.peers.values()], loaded)
    consumed = None
    if got.mapped is not None:
        path, mm = got.mapped
        inside = scalars(mm, loaded)
        if inside:
            consumed = Consumed(path, mm, inside, optimizers)
    mine = "replica" if got.replica else "memory"
    from_peers = [r for r, t in enumerate(gather(pg, mine)) if t == "replica"]
    _log.info(
        "restored step %d from %s; resuming at step %d",
        step,
        f"memory (ranks {from_peers} from replicas)" if from_peers else "memory",
        step + 1,
    )
    source = "replica" if from_peers else "memory"
    restored = Restored(
        step,
        mine,
        blob,
        [],
        blob.get("mlflow_run_id"),
        saved_step=offer.volume,
        where=f"step {step} from {source}",
        from_replicas=bool(from_peers),
    )
    return Loaded(restored, consumed)
