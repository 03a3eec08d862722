"""Models built on the meta device: storage before a restore, initialisation on a fresh start.

A restarted rank that builds its model the usual way spends time on a random
initialisation the restore then overwrites (half a second for 84 M weights on
a CPU rank; minutes for a large model). Built under ``torch.device("meta")``
the model has shapes and no storage; ``CheckpointManager.restore`` gives every
meta tensor empty storage on the rank's device, then loads the checkpoint into
it, or, when there is nothing to restore, initialises it (the ``init``
given, else each owning module's ``reset_parameters()``).

Parameters keep their identity (``torch.utils.swap_tensors``): an optimizer
built on the meta model before the restore optimizes the real tensors after
it. Tensors already on a real device are left as they are.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nbtools import runtime
from nbtools.errors import CheckpointError

__all__ = ["MetaModel", "find_meta", "rank_device"]

Init = Callable[[nn.Module], None]


def _gpu_or_default() -> torch.device:
    nccl = dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    default = torch.get_default_device()
    return torch.device("cpu") if default.type == "meta" else default


_warned_cpu = False


def rank_device() -> torch.device:
    """Where a rank's meta tensors get storage by default: its current GPU when the job's
    process group runs NCCL, else torch's default device (the CPU unless the user set one).

    CPU ranks on a machine with GPUs (``processes=N``, gloo) stay on the CPU, as a model
    built without the meta device would. When CUDA is available and this is the CPU
    (a one-GPU notebook with no process group), it warns once per process: the
    model's next line is often ``model.cuda()``, which leaves the optimizer's
    restored state on the CPU and fails the first step with a device mismatch.
    """
    global _warned_cpu
    chosen = _gpu_or_default()
    if chosen.type == "cpu" and not _warned_cpu and torch.cuda.is_available():
        _warned_cpu = True
        warnings.warn(
            "restore() gives the meta model's tensors storage on the CPU, though CUDA is "
            "available (no NCCL process group chose a GPU); pass restore(..., device='cuda') "
            "to restore onto the GPU, or device='cpu' to keep it on the CPU and silence this",
            UserWarning,
            stacklevel=3,
        )
    return chosen


@dataclass
class MetaModel:
    """One model with tensors on the meta device, and the modules that own them."""

    name: str
    model: nn.Module
    #: (qualified module name, module, names of its own meta parameters and buffers)
    owners: list[tuple[str, nn.Module, list[str]]] = field(default_factory=list)

    def materialize(self, device: torch.device) -> None:
        """Give every meta tensor empty storage on ``device``, parameters keeping their identity."""
        for _, module, names in self.owners:
            for name in names:
                if name in module._parameters:
                    param = module._parameters[name]
                    assert param is not None
                    if not param.is_meta:  # tied to a parameter materialized already
                        continue
                    real = nn.Parameter(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                    torch.utils.swap_tensors(param, real)
                else:
                    buffer = module._buffers[name]
                    assert buffer is not None
                    module._buffers[name] = torch.empty_like(buffer, device=device)

    def initialize(self, init: Init | None) -> None:
        """Initialise a materialized model for a fresh start (nothing was restored).

        With ``init``, call it on the model. Without, call ``reset_parameters()``
        on each module that owned a meta tensor (in registration order, as the
        modules' own constructors would have).
        """
        if init is not None:
            with torch.no_grad():
                init(self.model)
            return
        for qualified, module, _ in self.owners:
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):  # checked in find_meta; a module may drop it later
                raise CheckpointError(_no_reset(self.name, qualified, module))
            reset()


def _no_reset(model: str, qualified: str, module: nn.Module) -> str:
    where = f"{model}.{qualified}" if qualified else model
    return (
        f"{where} ({type(module).__name__}) was built on the meta device and has no "
        "reset_parameters() to initialise it on a fresh start (rank "
        f"{runtime.get_rank()}); pass restore(init=fn), where fn(model) initialises the "
        "whole model, or build that module on a real device"
    )


def find_meta(models: dict[str, nn.Module], init: Init | None) -> list[MetaModel]:
    """The models in ``models`` that hold meta tensors, checked before anything is loaded.

    Raises:
        CheckpointError: A non-persistent buffer is on the meta device (no
            checkpoint holds it, so nothing would fill it); a parameter on the meta device
            is a tensor subclass other than a DTensor (FSDP2's, tensor parallelism's);
            or, without
            ``init``, a module owning a meta tensor has no ``reset_parameters()``.
        TypeError: ``init`` is not callable.
    """
    if init is not None and not callable(init):
        raise TypeError(f"init must be a callable taking the model, not {type(init).__name__}")
    found = []
    for name, model in models.items():
        meta = MetaModel(name, model)
        for qualified, module in model.named_modules():
            own = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
            own += [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not own:
                continue
            where = f"{name}.{qualified}" if qualified else name
            lost = sorted(set(own) & module._non_persistent_buffers_set)
            if lost:
                raise CheckpointError(
                    f"{where}.{lost[0]} is a non-persistent buffer on the meta device (rank "
                    f"{runtime.get_rank()}): no checkpoint holds it, so a restore cannot fill "
                    "it; create it on a real device (pass device= to the tensor in __init__) "
                    "or register it as persistent"
                )
            for n in own:
                param = module._parameters.get(n)
                if param is not None and type(param) not in (nn.Parameter, DTensor):
                    raise CheckpointError(
                        f"{where}.{n} is a {type(param).__name__} on the meta device (rank "
                        f"{runtime.get_rank()}); restore gives storage to plain parameters "
                        "and DTensors only: call model.to_empty(device=...) yourself before restore"
                    )
            if init is None and not callable(getattr(module, "reset_parameters", None)):
                raise CheckpointError(_no_reset(name, qualified, module))
            meta.owners.append((qualified, module, own))
        if meta.owners:
            found.append(meta)
    return found
