"""The live tier: after a heal in place, ``restore()`` takes the state the surviving ranks hold.

With ``@distributed(heal=True)`` a rank that dies is replaced while the others
keep their processes, and the training function runs again in them (see
``nbtools.launch._rank._heal``). In data parallelism every survivor still holds
the model and optimizer of the last step all ranks completed: the objects its
manager's last ``maybe_save`` saw, which this module keeps a reference to
(:class:`LiveTier.snapshot`, a few microseconds a step: no tensor is copied).
The tier is the first a restore asks in a healed group, and offers that step
when:

- every survivor kept its objects, and none has changed since that
  ``maybe_save`` (every parameter's, persistent buffer's and optimizer state
  tensor's version counter is as it was then: an optimizer step or a forward
  pass that updated buffers after it would make the state newer than its step);
- the survivors agree on the step, and no state is sharded (a DTensor);
- each replaced rank finds its predecessor's per-rank state (RNG streams, the
  state of the other stateful objects, ``extra``) of that same step: every rank
  writes it at each ``maybe_save`` into the launch's directory, one small file
  replaced atomically (:data:`DIR_ENV`).

The load is then in place. A survivor swaps its live storage into the objects
its function built again (each parameter keeps its identity, so an optimizer
built on them stays valid; a model built on the meta device got empty storage
from ``restore()`` that the swap frees at once: the state is never held twice
for longer than that swap). The optimizer's state is handed over without a
copy. A replaced rank receives both from the lowest surviving rank, by a
broadcast over a group of the two. Every rank then takes its per-rank state
(the survivors their own, as of that step). Otherwise the tier says why in one
line and the memory snapshots, or the volume, are asked next, as after a
restart.

The same holds when the group changed size (``min_processes``): after a shrink
the survivors are renumbered and none is replaced; when the group grows back,
every rank of the smaller group checks at each ``maybe_save`` whether the
launcher asks it to (one all-reduce of a flag, only while it is smaller) and
raises :class:`GrowBoundary` there, all at the same step, after publishing that
step's state; the ranks that join are the replaced ones.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nbtools import runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _objects, _state
from nbtools.checkpoint._restore import Known, Newest, Offer, Restored

__all__ = ["LiveTier", "GrowBoundary", "DIR_ENV", "GENERATION_ENV", "REPLACED_ENV", "TARGET_ENV"]

_log = get_logger("checkpoint")

#: Set by the launcher in every rank of a group that heals (``nbtools.launch._rank._heal``
#: names the same variables): the launch's directory, the group's generation, the ranks
#: the last heal replaced.
DIR_ENV = "NBTOOLS_HEAL_DIR"
GENERATION_ENV = "NBTOOLS_HEAL_GENERATION"
REPLACED_ENV = "NBTOOLS_HEAL_REPLACED"
TARGET_ENV = "NBTOOLS_HEAL_TARGET"


class GrowBoundary(RuntimeError):
    """Raised by ``maybe_save`` in every rank of a group that shrank, at the same step, once
    the launcher has a lost slot started again: the function unwinds, and runs again in a
    group of the size it was started with (the state of that step held, as after a heal)."""


@dataclass
class _Held:
    """What this process's last ``maybe_save`` saw: the objects and their step."""

    step: int
    generation: int
    kinds: _objects.Objects
    blob: bytes  # the per-rank state at that step (torch.save of a plain dict)
    versions: tuple[int, ...]
    saved_step: int | None


# Module-level: it outlives the training function that unwound, and its manager.
_HELD: _Held | None = None


def gather(pg: dist.ProcessGroup, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (a collective over ``pg``)."""
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, value, group=pg)
    return out


def _generation() -> int:
    try:
        return int(os.environ.get(GENERATION_ENV) or 0)
    except ValueError:
        return 0


def _replaced() -> list[int]:
    text = os.environ.get(REPLACED_ENV) or ""
    return sorted(int(r) for r in text.split(",") if r.strip().isdigit())


def _blob_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"live-rank{rank}.pt")


def _note_path(directory: str, generation: int) -> str:
    return os.path.join(directory, f"heal-live-g{generation}.json")


def _tensors(kinds: _objects.Objects) -> list[torch.Tensor]:
    """The tensors whose versions tell whether the live state changed since its step."""
    found: list[torch.Tensor] = []
    for _, model in sorted(kinds.models.items()):
        found += [t for t in model.state_dict(keep_vars=True).values() if torch.is_tensor(t)]
    for _, (optim, _owner) in sorted(kinds.optimizers.items()):
        for state in optim.state.values():
            found += [t for t in state.values() if torch.is_tensor(t)]
    return found


def _versions(kinds: _objects.Objects) -> tuple[int, ...]:
    return tuple(t._version for t in _tensors(kinds))


class LiveTier:
    """The first tier of a manager in a group that heals (see the module docstring).

    Args:
        saved_step: The manager's newest complete checkpoint on the volume, as it knows it.
    """

    name = "live"

    def __init__(self, saved_step: Callable[[], int | None]) -> None:
        self._saved_step = saved_step
        self._dir = os.environ.get(DIR_ENV) or ""

    @staticmethod
    def active() -> bool:
        """Whether this process is a rank of a group that heals."""
        return bool(os.environ.get(DIR_ENV))

    def snapshot(
        self, step: int, objs: dict[str, Any], extra: dict[str, Any] | None, run_id: str | None
    ) -> bool:
        """Remember ``objs`` as the state of ``step`` and publish this rank's per-rank state."""
        global _HELD
        kinds = _objects.classify(objs)
        blob = {
            "step": step,
            "rng": _state.capture_rng(),
            "objects": {name: obj.state_dict() for name, obj in kinds.stateful.items()},
            "extra": dict(extra or {}),
            "mlflow_run_id": run_id,
        }
        buf = io.BytesIO()
        torch.save(blob, buf)
        data = buf.getvalue()
        _HELD = _Held(step, _generation(), kinds, data, _versions(kinds), self._saved_step())
        if self._dir:
            path = _blob_path(self._dir, runtime.get_rank())
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, path)
            except OSError:  # the launch's directory is gone: the call is ending
                return False
            self._grow_here(step)
        return False

    def _grow_here(self, step: int) -> None:
        """In a group that shrank: raise :class:`GrowBoundary` when every rank sees that the
        launcher asks it to grow (one all-reduce of a flag a step, only while it is smaller)."""
        try:
            target = int(os.environ.get(TARGET_ENV) or 0)
        except ValueError:
            return
        if not dist.is_initialized() or dist.get_world_size() >= target:
            return
        asked = os.path.exists(os.path.join(self._dir, f"heal-grow-g{_generation()}"))
        flag = torch.tensor([1 if asked else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            raise GrowBoundary(
                f"the group of {dist.get_world_size()} ranks grows back to {target} after step "
                f"{step}"
            )

    def offers(self, pg: dist.ProcessGroup | None, below: Newest) -> Offer | None:
        """The step the survivors hold, when every rank can take it (see the module docstring)."""
        generation = _generation()
        if generation == 0 or pg is None:
            return None
        rank, replaced = runtime.get_rank(), _replaced()
        facts = gather(pg, self._facts(rank, rank in replaced, generation))
        survivors = [f for f in facts if f["rank"] not in replaced]
        live = max((f["step"] for f in survivors if f["step"] is not None), default=None)
        why = _why_not(facts, replaced)
        if rank == 0 and self._dir:
            note = {"live_step": live, "why": why, "batch": _batch_line(_HELD, len(facts))}
            try:
                with open(_note_path(self._dir, generation), "w") as fh:
                    json.dump(note, fh)
            except OSError:
                pass
        if why is not None:
            if rank == 0:
                _log.warning(
                    "the state the ranks kept cannot be restored (%s); restoring "
                    "from the snapshots instead",
                    why,
                )
            return None
        assert live is not None
        saved = [f["saved"] for f in survivors if f["saved"] is not None]
        source = min(f["rank"] for f in survivors)
        return Offer("live", live, held=(source, replaced, max(saved) if saved else None))

    def _facts(self, rank: int, replaced: bool, generation: int) -> dict[str, Any]:
        """What this rank can give a live restore, for the others to agree on."""
        facts: dict[str, Any] = {"rank": rank, "step": None, "saved": None, "why": None}
        if replaced:
            try:
                with open(_blob_path(self._dir, rank), "rb") as fh:
                    blob = torch.load(io.BytesIO(fh.read()), weights_only=True)
                facts["step"] = int(blob["step"])
            except (OSError, KeyError, RuntimeError, ValueError) as exc:
                facts["why"] = f"rank {rank} finds no per-rank state of its predecessor ({exc})"
            return facts
        held = _HELD
        if held is None:
            facts["why"] = f"rank {rank} kept no state (no maybe_save or restore since it started)"
        elif held.generation != generation - 1:
            facts["why"] = f"rank {rank}'s state is from before an earlier heal"
        elif _versions(held.kinds) != held.versions:
            facts["why"] = (
                f"rank {rank}'s state changed after its last maybe_save (step {held.step}): an "
                "optimizer step or a forward pass that updates buffers ran after it"
            )
        elif any(isinstance(t, DTensor) for t in _tensors(held.kinds)):
            facts["why"] = "the state is sharded (DTensor): a dead rank's shard is gone"
        else:
            facts["step"], facts["saved"] = held.step, held.saved_step
        return facts

    def load(
        self,
        pg: dist.ProcessGroup | None,
        offer: Offer,
        kinds: _objects.Objects,
        planner: Any,
    ) -> Restored | None:
        """Swap the live state into ``kinds``' objects, send it to the replaced ranks."""
        global _HELD
        assert pg is not None and offer.step is not None
        source, replaced, saved_step = offer.held
        rank = runtime.get_rank()
        held = _HELD
        problem = None
        if rank not in replaced:
            assert held is not None
            problem = _mismatch(held.kinds, kinds)
        agreed = gather(pg, problem)
        problems = [p for p in agreed if p is not None]
        if problems:
            if rank == 0:
                _log.warning(
                    "the state the ranks kept cannot be restored (%s); restoring "
                    "from the snapshots instead",
                    problems[0],
                )
            return None
        if rank not in replaced:
            assert held is not None
            _adopt(held.kinds, kinds)
            data = held.blob
        else:
            with open(_blob_path(self._dir, rank), "rb") as fh:
                data = fh.read()
        _HELD = None  # consumed: the objects now share its storage (held again below)
        members = [source, *replaced]
        sub = dist.new_group(ranks=members, backend="gloo")  # every rank makes it
        try:
            if rank in members:
                _send_or_receive(kinds, source, sub, receive=rank != source)
        finally:
            dist.destroy_process_group(sub)
        blob = torch.load(io.BytesIO(data), weights_only=True)
        for name, obj in kinds.stateful.items():
            obj.load_state_dict(blob["objects"][name])
        _state.restore_rng(blob["rng"])
        # The restored objects hold that step now: a rank that dies before the next
        # maybe_save heals from them again.
        _HELD = _Held(offer.step, _generation(), kinds, data, _versions(kinds), saved_step)
        return Restored(
            step=offer.step,
            tier="live",
            blob=blob,
            mlflow_run_id=blob.get("mlflow_run_id"),
            saved_step=saved_step,
            where=f"step {offer.step} from the ranks that kept their processes",
        )

    def newest(self, pg: dist.ProcessGroup | None) -> Known:
        """Not asked: the live tier is the first."""
        return Known()

    def note_volume(self, step: int | None) -> None:
        """Nothing to learn: the live state is not kept across restores."""

    def close(self, keep: bool) -> None:
        """A clean close lets the objects go; after an error they stay for a heal."""
        global _HELD
        if not keep:
            _HELD = None


def _batch_line(held: _Held | None, world: int) -> str | None:
    """``"global batch 512 kept: 74 or 73 samples per rank"`` for a loader among the held
    objects with ``global_batch_size=``, at the group's new world size ``world`` (the
    launcher's line about a group that changed size); None without one."""
    for obj in held.kinds.stateful.values() if held is not None else ():
        size = getattr(getattr(obj, "batch_plan", None), "global_batch_size", None)
        if isinstance(size, int) and size >= world:
            plan = runtime.batch_plan(size, world_size=world, rank=0)
            return f"global batch {size} kept: {plan.describe()}"
    return None


def _why_not(facts: list[dict[str, Any]], replaced: list[int]) -> str | None:
    """Why the ranks cannot take the live state (one phrase), or None when they can."""
    for fact in facts:
        if fact["why"] is not None:
            return str(fact["why"])
    steps = {f["rank"]: f["step"] for f in facts}
    held = {steps[r] for r in steps if r not in replaced}
    if len(held) != 1:
        return f"the ranks that kept their processes hold different steps ({steps})"
    (step,) = held
    for rank in replaced:
        if steps[rank] != step:
            return (
                f"rank {rank}'s newest per-rank state is of step {steps[rank]}, the kept "
                f"state of step {step}"
            )
    return None


def _mismatch(old: _objects.Objects, new: _objects.Objects) -> str | None:
    """Why ``old``'s state cannot go into ``new``'s objects, or None."""
    if set(old.models) != set(new.models) or set(old.optimizers) != set(new.optimizers):
        return "the objects passed to restore() are not those passed to maybe_save()"
    for name, model in new.models.items():
        before = old.models[name].state_dict(keep_vars=True)
        after = model.state_dict(keep_vars=True)
        if list(before) != list(after) or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(before.values(), after.values(), strict=True)
        ):
            return f"model {name!r} is not built as the one kept"
    if set(old.stateful) != set(new.stateful):
        return "the stateful objects passed to restore() are not those passed to maybe_save()"
    return None


def _adopt(old: _objects.Objects, new: _objects.Objects) -> None:
    """Put ``old``'s state into ``new``'s objects without copying what is large."""
    for name, model in new.models.items():
        kept = old.models[name]
        if kept is model:
            continue
        before = kept.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, tensor in model.state_dict(keep_vars=True).items():
                if isinstance(tensor, nn.Parameter):
                    tensor.data = before[key].data  # the parameter keeps its identity
                else:
                    tensor.copy_(before[key])
    for name, (optim, _) in new.optimizers.items():
        kept_optim = old.optimizers[name][0]
        if kept_optim is not optim:
            optim.load_state_dict(kept_optim.state_dict())  # its tensors, not copies


def _send_or_receive(
    kinds: _objects.Objects, source: int, group: dist.ProcessGroup, receive: bool
) -> None:
    """Broadcast the models' and optimizers' state from ``source`` over ``group``."""
    for _, model in sorted(kinds.models.items()):
        for tensor in model.state_dict().values():
            _broadcast(tensor, source, group)
    for _, (optim, _owner) in sorted(kinds.optimizers.items()):
        layout: list[Any] = [None if receive else _skeleton(optim.state_dict())]
        dist.broadcast_object_list(layout, src=source, group=group)
        skeleton = layout[0]
        tensors = [] if receive else _flat(optim.state_dict())
        if receive:
            tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in _shapes(skeleton)]
        for tensor in tensors:
            _broadcast(tensor, source, group)
        if receive:
            optim.load_state_dict(_fill(skeleton, iter(tensors)))


def _broadcast(tensor: torch.Tensor, source: int, group: dist.ProcessGroup) -> None:
    if tensor.is_contiguous():
        dist.broadcast(tensor, src=source, group=group)
        return
    buf = tensor.contiguous()
    dist.broadcast(buf, src=source, group=group)
    tensor.copy_(buf)


_TENSOR = "__nbtools_tensor__"


def _skeleton(value: Any) -> Any:
    if torch.is_tensor(value):
        return (_TENSOR, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v) for v in value)
    return value


def _is_slot(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and value[0] == _TENSOR


def _flat(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value.contiguous()]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def _shapes(skeleton: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    if _is_slot(skeleton):
        return [(skeleton[1], skeleton[2])]
    if isinstance(skeleton, dict):
        return [s for v in skeleton.values() for s in _shapes(v)]
    if isinstance(skeleton, (list, tuple)):
        return [s for v in skeleton for s in _shapes(v)]
    return []


def _fill(skeleton: Any, tensors: Any) -> Any:
    if _is_slot(skeleton):
        return next(tensors)
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton
