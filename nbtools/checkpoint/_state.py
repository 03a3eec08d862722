"""What a checkpoint holds, and putting it back.

Layout of the DCP state dict (flattened keys in ``.metadata``)::

    <model name>.<param fqn>          model weights (get_model_state_dict; replicated ones written once)
    <optimizer name>.state.<...>      optimizer state (get_optimizer_state_dict)
    step                              the step, for readers that use plain DCP
    nbtools.rank_<r>                  per-rank bytes: RNG streams, state of the other
                                      stateful objects, extra, MLflow run id

Per-rank state is a ``torch.save`` blob restricted to what
``torch.load(weights_only=True)`` accepts; the RNG streams of Python, NumPy,
torch CPU and every CUDA device in it are plain Python data and tensors. When the world size changes, rank r
restores the per-rank state saved by rank r if there was one, else rank 0's.

The objects themselves, sorted by kind and checked, are ``_objects``.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nbtools._internal.log import get_logger
from nbtools.checkpoint._objects import Objects
from nbtools.errors import CheckpointError

__all__ = [
    "build_state",
    "load_template",
    "blob_template",
    "decode_blob",
    "apply_state",
    "source_rank",
    "NS",
    "capture_rng",
    "restore_rng",
]

_log = get_logger("checkpoint")

NS = "nbtools"  # in _objects.RESERVED: no object passed takes this name


def capture_rng() -> dict[str, Any]:
    """The current state of every RNG stream this process uses."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    else:
        # The global RandomState runs MT19937, whose legacy state is this 5-tuple (the stub
        # also allows the dict that other bit generators give).
        legacy = cast("tuple[str, np.ndarray[Any, Any], int, int, float]", np.random.get_state())
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the streams captured by :func:`capture_rng` (CUDA devices that exist here)."""
    random.setstate(
        tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:])
    )
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        for i, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, i)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def build_state(
    step: int, objs: Objects, rank: int, world: int, extra: dict[str, Any], run_id: str | None
) -> dict[str, Any]:
    """The DCP state dict of a save at this moment."""
    state: dict[str, Any] = {"step": step}
    for name, model in objs.models.items():
        state[name] = get_model_state_dict(model)
    for name, (optim, owner) in objs.optimizers.items():
        state[name] = get_optimizer_state_dict(owner, optim)
    blob = {
        "step": step,
        "rank": rank,
        "world_size": world,
        "kinds": {
            **dict.fromkeys(objs.models, "model"),
            **dict.fromkeys(objs.optimizers, "optimizer"),
            **dict.fromkeys(objs.stateful, "stateful"),
        },
        "rng": capture_rng(),
        "objects": {name: obj.state_dict() for name, obj in objs.stateful.items()},
        "extra": dict(extra),
        "mlflow_run_id": run_id,
    }
    try:
        state[NS] = {f"rank_{rank}": _dumps(blob)}
    except Exception as exc:
        raise TypeError(f"the per-rank state cannot be serialised: {exc}") from exc
    return state


def source_rank(metadata: Metadata, rank: int) -> int:
    """The saved rank whose per-rank state this rank restores."""
    return rank if f"{NS}.rank_{rank}" in metadata.state_dict_metadata else 0


def _check_keys(name: str, template: dict[str, Any], metadata: Metadata, where: str) -> None:
    saved = {k[len(name) + 1 :] for k in metadata.state_dict_metadata if k.startswith(name + ".")}
    if not saved:
        raise CheckpointError(f"{where} holds no {name!r}; pass only objects that were saved")
    wanted = set(template)
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"cannot restore {name!r} from {where}: parameter names do not match.\n"
            f"  missing in the checkpoint ({len(missing)}): {missing[:20]}\n"
            f"  unexpected in the checkpoint ({len(unexpected)}): {unexpected[:20]}\n"
            "Build the same model as the one saved (same module names), or export the weights "
            "and load them with your own key mapping"
        )


def load_template(objs: Objects, metadata: Metadata, where: str) -> dict[str, Any]:
    """The state dict ``dcp.load`` fills in place for a restore."""
    state: dict[str, Any] = {}
    for name, model in objs.models.items():
        state[name] = get_model_state_dict(model)
        _check_keys(name, state[name], metadata, where)
    for name, (optim, owner) in objs.optimizers.items():
        if not any(k.startswith(name + ".") for k in metadata.state_dict_metadata):
            raise CheckpointError(f"{where} holds no optimizer {name!r}; restore without it")
        state[name] = get_optimizer_state_dict(owner, optim)
    return state


def blob_template(metadata: Metadata, rank: int) -> dict[str, Any]:
    """The state dict that loads this rank's per-rank bytes."""
    return {NS: {f"rank_{source_rank(metadata, rank)}": b""}}


def _blob_location(storage: Any, location: str) -> Any:
    """``torch.load``'s ``map_location`` for a rank's own saved objects: what was saved on
    a GPU comes back on this rank's current GPU (not the saving rank's index, after a
    change of world size another rank's), or on the CPU where there is none; what was
    saved on the CPU (RNG states) stays there."""
    if not location.startswith("cuda") or not torch.cuda.is_available():
        return storage
    return storage.cuda(torch.cuda.current_device())


def decode_blob(state: dict[str, Any], objs: Objects, where: str) -> dict[str, Any]:
    """The per-rank state loaded into a :func:`blob_template`; checks every stateful object is in it."""
    (data,) = state[NS].values()
    blob = torch.load(io.BytesIO(data), weights_only=True, map_location=_blob_location)
    missing = sorted(set(objs.stateful) - set(blob["objects"]))
    if missing:
        raise CheckpointError(
            f"{where} holds no state for {missing} (saved: {sorted(blob['kinds'])}); pass only "
            "objects that were saved"
        )
    return blob


def apply_state(objs: Objects, state: dict[str, Any], blob: dict[str, Any]) -> None:
    """Load the filled template and the per-rank state into the objects and RNG streams."""
    for name, model in objs.models.items():
        set_model_state_dict(model, state[name])
    for name, (optim, owner) in objs.optimizers.items():
        with _no_warm_up_step(optim):
            set_optimizer_state_dict(owner, optim, state[name])
    for name, obj in objs.stateful.items():
        obj.load_state_dict(blob["objects"][name])
    restore_rng(blob["rng"])


@contextlib.contextmanager
def _no_warm_up_step(optim: torch.optim.Optimizer) -> Iterator[None]:
    """Load into an optimizer that has no state yet without DCP's warm-up step.

    ``set_optimizer_state_dict`` first gives a stateless optimizer its state by
    running one step with zero gradients and a zero learning rate (a full pass over
    every parameter, plus the state's allocation), then replaces all of that state
    with the loaded one. A placeholder entry tells it the state exists; the load
    replaces the placeholder with the rest, and a failed load leaves no trace of it.
    The loaded tensors are used as they are (same dtype and device: no copy).
    """
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or not params or any(p.grad is not None for p in params):
        yield
        return
    placeholder: dict[str, Any] = {}
    optim.state[params[0]] = placeholder
    try:
        yield
    finally:
        if optim.state.get(params[0]) is placeholder:
            del optim.state[params[0]]
