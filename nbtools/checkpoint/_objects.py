"""The objects a checkpoint covers: what the user passes, sorted by kind, and checked.

The manager's saves and every tier's restore take keyword objects (``model=``,
``optim=``, ``loader=``...); :func:`classify` sorts them into models, optimizers
(each with the model it optimizes) and other stateful objects (:class:`Objects`).

What trainers' wrappers hand the user is accepted as it is: Lightning Fabric's
``_FabricModule`` and ``_FabricOptimizer`` and accelerate's
``AcceleratedOptimizer`` stand for the objects they wrap, as DCP sees through DDP's
``module.`` and compile's ``_orig_mod.``; accelerate's prepared ``DataLoaderShard``
gets a position (:class:`LoaderPosition`), and the ``Accelerator`` itself its place in
``accumulate()`` (:class:`AccumulationPosition`). A wrapper not understood is refused by
:func:`check_objects`, which the manager runs at the first save call.

What a checkpoint holds of these objects, and putting it back, is ``_state``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nbtools._internal.log import get_logger
from nbtools.errors import CheckpointError

__all__ = [
    "Objects",
    "classify",
    "check_objects",
    "AccumulationPosition",
    "LoaderPosition",
    "RESERVED",
]

_log = get_logger("checkpoint")

#: The state dict's own keys (``step``, ``extra`` and ``_state.NS``): no object takes them.
RESERVED = frozenset({"step", "extra", "nbtools"})


class Objects:
    """The keyword objects of a save or restore, sorted by kind."""

    def __init__(self) -> None:
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, tuple[torch.optim.Optimizer, nn.Module]] = {}
        self.stateful: dict[str, Any] = {}


def classify(objs: dict[str, Any]) -> Objects:
    """Sort keyword objects into models, optimizers (with their model) and other stateful ones."""
    out = Objects()
    for name, given in objs.items():
        if name in RESERVED or "." in name:
            raise ValueError(
                f"{name!r} cannot name a saved object (reserved or contains '.'); rename it"
            )
        obj = _unwrap(given)
        if isinstance(obj, nn.Module):
            out.models[name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            out.optimizers[name] = (obj, None)  # type: ignore[assignment]
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            out.stateful[name] = obj
        elif _is(obj, _FABRIC_LOADER):
            raise TypeError(
                f"{name}={type(obj).__name__} wraps a {type(obj._dataloader).__name__}, which "
                "keeps no position; give fabric.setup_dataloaders() torchdata's "
                "StatefulDataLoader (over a DistributedSampler on several ranks) instead"
            )
        else:
            raise TypeError(
                f"{name}={type(obj).__name__} has no state_dict()/load_state_dict(); pass models, "
                "optimizers and stateful objects only (put plain values in extra={...})"
            )
    for name, (optim, _) in list(out.optimizers.items()):
        params = {id(p) for group in optim.param_groups for p in group["params"]}
        owner = next(
            (m for m in out.models.values() if any(id(p) in params for p in m.parameters())), None
        )
        if owner is None:
            raise ValueError(
                f"optimizer {name!r} optimizes no parameter of the models passed; pass its model too"
            )
        out.optimizers[name] = (optim, owner)
    return out


# --- trainers' wrappers -------------------------------------------------------------

# Classes by "module.qualname", so that neither library is imported to recognise them.
_FABRIC_MODULE = frozenset(
    f"{pkg}.wrappers._FabricModule" for pkg in ("lightning.fabric", "lightning_fabric")
)
_FABRIC_OPTIMIZER = frozenset(
    f"{pkg}.wrappers._FabricOptimizer" for pkg in ("lightning.fabric", "lightning_fabric")
)
_FABRIC_LOADER = frozenset(
    f"{pkg}.wrappers._FabricDataLoader" for pkg in ("lightning.fabric", "lightning_fabric")
)
_ACCELERATE_OPTIMIZER = frozenset({"accelerate.optimizer.AcceleratedOptimizer"})
_ACCELERATE_SHARD = frozenset({"accelerate.data_loader.DataLoaderShard"})
_ACCELERATE_ADAPTER = frozenset({"accelerate.data_loader.DataLoaderAdapter"})
_ACCELERATOR = frozenset({"accelerate.accelerator.Accelerator"})
# Module names DCP leaves out of a parameter's name: compile's, FSDP1's and activation
# checkpointing's wrappers (DDP's "module" is left out only under a DDP, see _dcp_names).
_SEEN_THROUGH = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _is(obj: Any, names: frozenset[str]) -> bool:
    """Whether the object's own type (not a ``__class__`` it reports) derives from one of ``names``."""
    return any(f"{cls.__module__}.{cls.__qualname__}" in names for cls in type(obj).__mro__)


def _unwrap(obj: Any) -> Any:
    """The object a checkpoint holds for what a trainer's wrapper handed the user."""
    if _is(obj, _FABRIC_MODULE):
        return obj._forward_module  # the strategy's module (DDP, FSDP...) that DCP reads
    if _is(obj, _FABRIC_OPTIMIZER | _ACCELERATE_OPTIMIZER):
        return obj.optimizer
    if _is(obj, _ACCELERATE_SHARD):
        return LoaderPosition.of(obj)
    if _is(obj, _ACCELERATOR):
        return AccumulationPosition(obj)
    if _is(obj, _FABRIC_LOADER) and callable(getattr(obj._dataloader, "state_dict", None)):
        return _FabricLoaderPosition(obj)
    return obj


class _FabricLoaderPosition:
    """Fabric's ``_FabricDataLoader`` over a loader with a position of its own (torchdata's
    ``StatefulDataLoader``...): that position, and Fabric's count of passes, from which it
    sets the sampler's epoch as a pass starts.

    A pass put back in its middle starts again, and a loader without a ``generator``
    draws its pass's seed from torch's generator as the pass starts. The saved pass drew
    it before the save, so the pass started again draws it from a generator of its own,
    and the passes after it from torch's again (told apart by the sampler's
    ``set_epoch``, which Fabric calls as each pass starts).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.inner = loader._dataloader

    def state_dict(self) -> dict[str, Any]:
        """Fabric's count of passes and the wrapped loader's own state."""
        return {"passes": self.loader._num_iter_calls, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass continue the saved one, or start the next one."""
        inner, passes = state["inner"], state["passes"]
        marks = inner if isinstance(inner, dict) else {}
        if marks.get("_num_yielded") == len(self.inner) and not marks.get("_iterator_finished"):
            # Its last batch was handed out and the pass not yet ended: torchdata would
            # resume it as an empty pass; the next pass is the one after it.
            self.loader._num_iter_calls = passes
            return
        self.inner.load_state_dict(inner)
        if passes == 0 or marks.get("_iterator_finished"):
            self.loader._num_iter_calls = passes
            return
        self.loader._num_iter_calls = passes - 1  # the saved pass, started again
        samplers = [
            getattr(self.inner, "sampler", None),
            getattr(getattr(self.inner, "batch_sampler", None), "sampler", None),
        ]
        sampler = next((s for s in samplers if callable(getattr(s, "set_epoch", None))), None)
        if self.inner.generator is not None or sampler is None:
            return
        inner_loader, again, set_epoch = self.inner, passes - 1, sampler.set_epoch
        inner_loader.generator = torch.Generator()

        def on_set_epoch(epoch: int) -> None:
            if epoch != again:  # a later pass: its seed comes from torch's generator again
                inner_loader.generator = None
                del sampler.set_epoch
            set_epoch(epoch)

        sampler.set_epoch = on_set_epoch


class LoaderPosition:
    """The position of accelerate's prepared ``DataLoaderShard`` in its passes.

    accelerate's loader keeps no position a checkpoint can use: its ``state_dict()`` works
    only over a ``StatefulDataLoader`` and leaves out which pass it is in. This object
    follows the loader through two of its methods, set on the instance: ``set_epoch``,
    called as each pass starts (after accelerate synchronised its generators), and
    ``_update_state_dict``, called once per batch the pass fetches. It holds the pass
    under way, the batches it fetched, and the generators as it started: torch's, from
    which the pass draws its seeds, and the loader's own (accelerate's synchronised one).

    Put back in the middle of a pass, the loader's next pass is that pass again: the
    generators as it started, so it draws the same order, the batches already trained on
    skipped (accelerate's ``skip_batches``, which still loads them), then the generators
    as they were at the save, so what follows draws what it drew. Put back at the end of
    a pass, the next pass is the one after it.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch: int | None = None  # the pass under way, once one started while followed
        self.fetched = 0
        self.start: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self._after: dict[str, Any] | None = None
        self._warned = False
        self._skip = loader.skip_batches
        self._set_epoch: Callable[[int], None] = loader.set_epoch
        self._update: Callable[[], None] = loader._update_state_dict
        loader.set_epoch = self._on_set_epoch
        loader._update_state_dict = self._on_update

    @classmethod
    def of(cls, loader: Any) -> LoaderPosition:
        """The one position that follows ``loader`` (made and hooked the first time)."""
        held = vars(loader).get("_nbtools_position")
        if not isinstance(held, LoaderPosition):
            held = vars(loader)["_nbtools_position"] = cls(loader)
        return held

    def _in_pass(self) -> bool:
        refs = getattr(getattr(self.loader, "gradient_state", None), "dataloader_references", [])
        return any(ref is self.loader for ref in refs or [])

    def _generators(self) -> list[torch.Generator]:
        found: list[torch.Generator] = []
        for gen in (self.loader.synchronized_generator, getattr(self.loader, "generator", None)):
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def _capture(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "generators": [g.get_state() for g in self._generators()],
        }

    def _put(self, state: dict[str, Any], *, with_torch: bool) -> None:
        if with_torch:
            torch.set_rng_state(state["torch"])
        for gen, gen_state in zip(self._generators(), state["generators"], strict=False):
            gen.set_state(gen_state)

    def _on_set_epoch(self, epoch: int) -> None:
        resume, self._resume = self._resume, None
        if resume is not None and resume["iteration"] == epoch and resume["start"] is not None:
            self._put(resume["start"], with_torch=True)
            self.loader.skip_batches = resume["fetched"]
            self._after = resume
        else:
            self.loader.skip_batches = self._skip
            self._after = None
        self.epoch, self.fetched, self.start = epoch, 0, self._capture()
        self._set_epoch(epoch)

    def _on_update(self) -> None:
        self.fetched += 1
        after = self._after
        if after is not None and self.fetched == after["fetched"] + 1:
            self._after = None  # the skipped batches are behind: as at the save from here on
            self._put(after["now"], with_torch=True)
            self.loader.skip_batches = self._skip
        self._update()

    def state_dict(self) -> dict[str, Any]:
        """The pass under way, the batches it fetched, and the generators (plain data)."""
        now = self._capture()
        if self.epoch is None and not self._warned and self._in_pass():
            self._warned = True
            _log.warning(
                "accelerate's prepared loader was already in a pass when it was first given to "
                "the checkpoint manager: a restore starts that pass again from its first batch. "
                "Give the loader to restore() (or save) before iterating it"
            )
        if self.epoch is None or self.loader.iteration != self.epoch:  # between passes
            return {
                "iteration": self.loader.iteration,
                "fetched": 0,
                "finished": False,
                "start": None,
                "now": now,
            }
        return {
            "iteration": self.epoch,
            "fetched": self.fetched,
            "finished": bool(self.loader.end_of_dataloader),
            "start": self.start,
            "now": now,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the loader's next pass continue the saved one (see the class docstring)."""
        if state["finished"] or not state["fetched"] or state["start"] is None:
            self.loader.iteration = state["iteration"] + int(state["finished"])
            self._put(state["now"], with_torch=False)
            self._resume = None
            return
        self.loader.iteration = state["iteration"]
        self._resume = dict(state)


class AccumulationPosition:
    """Where an ``Accelerator`` is in its gradient accumulation: what ``accumulate()``
    counts, and the gradients accumulated so far.

    ``accumulate()`` counts the micro-batches (``Accelerator.step``, set back to 0 at the
    end of a pass) and lets the optimizer step at each ``gradient_accumulation_steps``-th.
    Saved between two of those steps, the count and the gradients the prepared models
    have accumulated since the last one (per rank: DDP has not reduced them yet) are
    what the next micro-batches add to; put back, the optimizer steps where and with
    what it would have.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def _parameters(self) -> list[torch.Tensor]:
        return [p for model in self.accelerator._models for p in model.parameters()]

    def state_dict(self) -> dict[str, Any]:
        """The count and, between two optimizer steps, a copy of each parameter's gradient."""
        acc = self.accelerator
        grads = None
        if not acc.sync_gradients:  # the optimizer skipped this micro-batch's step
            grads = [
                None if p.grad is None else p.grad.detach().clone() for p in self._parameters()
            ]
        return {"step": int(acc.step), "grads": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the count and the gradients back."""
        self.accelerator.step = int(state["step"])
        grads = state["grads"]
        params = self._parameters()
        if grads is None:
            return
        if len(grads) != len(params):
            raise CheckpointError(
                f"the checkpoint holds the accumulated gradients of {len(grads)} parameters; "
                f"this Accelerator's prepared models have {len(params)}: prepare the same models"
            )
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param.grad = None if grad is None else grad.to(param.device).clone()


def _dcp_names(model: nn.Module) -> dict[str, int]:
    """The names DCP looks for when it loads ``model``: its parameters' and persistent
    buffers' paths in the module tree, less the wrappers DCP sees through (each tensor
    once, under the first path to it), with the id of the tensor."""
    names: dict[str, int] = {}
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> None:
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or key in module._non_persistent_buffers_set:
                continue
            if id(tensor) not in seen:
                seen.add(id(tensor))
                names[prefix + key] = id(tensor)
        ddp = isinstance(module, nn.parallel.DistributedDataParallel)
        for key, child in module._modules.items():
            if child is not None:
                through = key in _SEEN_THROUGH or (ddp and key == "module")
                walk(child, prefix if through else f"{prefix}{key}.")

    walk(model, "")
    return names


def _wrapped_attribute(model: nn.Module) -> str | None:
    """The name of the child module holding every parameter of ``model``, if one does."""
    mine = {id(p) for p in model.parameters()}
    for key, child in model._modules.items():
        if child is not None and mine and {id(p) for p in child.parameters()} == mine:
            return key
    return None


def _check_model(name: str, given: Any, model: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return  # FSDP1's flat parameters are named by FSDP itself, which DCP reads
    kind = type(given).__name__
    attr = _wrapped_attribute(model)
    instead = (
        f"Pass {name}=<your {kind}>.{attr} instead" if attr else "Pass the module it wraps instead"
    )
    understood = (
        "(DDP, FSDP, torch.compile, Lightning Fabric and accelerate are understood as they are)"
    )
    try:
        saved = set(get_model_state_dict(model))
    except Exception as exc:  # a wrapper DCP cannot read
        raise CheckpointError(
            f"{name}={kind} is a wrapper nbtools does not understand: reading its state "
            f"failed ({type(exc).__name__}: {exc}). {instead} {understood}"
        ) from exc
    missing = [n for n in _dcp_names(model) if n not in saved]
    if missing:
        raise CheckpointError(
            f"{name}={kind} is a wrapper nbtools does not understand: its state_dict() names "
            f"its parameters otherwise than its modules do ({missing[0]!r} is not in it), so its "
            "checkpoints would hold names a restore may not find (failing with 'Missing key "
            f"{missing[0]}'). {instead} {understood}"
        )


def _check_accumulation(objs: dict[str, Any]) -> None:
    """Refuse accelerate's optimizer under gradient accumulation without its Accelerator,
    whose count says where between two optimizer steps a save comes."""
    if any(_is(obj, _ACCELERATOR) for obj in objs.values()):
        return
    for name, obj in objs.items():
        steps = getattr(getattr(obj, "gradient_state", None), "num_steps", 1)
        if _is(obj, _ACCELERATE_OPTIMIZER) and isinstance(steps, int) and steps > 1:
            raise CheckpointError(
                f"{name}={type(obj).__name__} steps every {steps} micro-batches "
                "(gradient_accumulation_steps), and where a save comes between two of its "
                "steps is counted by the Accelerator: pass it too (accelerator=accelerator) so "
                "that a restore steps the optimizer where the run would have"
            )


def check_objects(objs: dict[str, Any]) -> None:
    """Refuse, before anything is saved, the objects a checkpoint could not put back.

    Raises:
        CheckpointError: A wrapper not understood: a model whose ``state_dict()`` names
            its parameters otherwise than its module tree (DCP saves its weights and its
            optimizer's state under different names, and a restore may fail), an
            optimizer wrapping another one without sharing its state, an accelerate
            loader that dispatches batches, or accelerate's optimizer under gradient
            accumulation without its ``Accelerator``. The message names the wrapper's
            type and what to pass instead.
    """
    kinds = classify(objs)
    for name, model in kinds.models.items():
        _check_model(name, objs[name], model)
    _check_accumulation(objs)
    for name, (optim, _) in kinds.optimizers.items():
        inner = getattr(optim, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optim:
            if optim.state is not inner.state:
                raise CheckpointError(
                    f"{name}={type(optim).__name__} wraps the optimizer "
                    f"{type(inner).__name__} without sharing its state, which nbtools does "
                    f"not understand; pass {name}=<your {type(optim).__name__}>.optimizer "
                    "instead"
                )
    for name, obj in kinds.stateful.items():
        if _is(obj, _ACCELERATE_ADAPTER):  # a prepared loader other than DataLoaderShard
            raise CheckpointError(
                f"{name}={type(obj).__name__}: accelerate's loader that dispatches batches "
                "from rank 0 keeps no position nbtools can put back; prepare the DataLoader "
                "with Accelerator(dataloader_config=DataLoaderConfiguration("
                "dispatch_batches=False)) and pass what prepare() returns"
            )
