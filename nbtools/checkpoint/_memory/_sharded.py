"""Sharded state (DTensor: FSDP2's ``fully_shard``, tensor parallelism) in a snapshot.

A DTensor is a rank's local shard of a tensor laid out over a device mesh. A
snapshot holds each rank's local shards (as plain tensors, in its own slot)
together with what puts them back (:func:`flatten`): the mesh (its ranks and
dimension names), the placements, the global shape and stride, this rank's
coordinate in the mesh and the offset of its shard in the global tensor. Those
shards are this rank's own: the ranks of a node never split them between them
as they split replicated plain tensors (see ``_layout``), since equal names and
shapes do not mean equal values here.

A restore at the same world size and mesh puts each local shard back as a DTensor
on the mesh the restoring models use now (:func:`unflatten`), from this rank's
slot or a peer's replica, reading nothing from the volume. Where the mesh, the
placements or this rank's place in the mesh differ, the snapshot cannot be put
back shard for shard: :func:`unflatten` says why, and the restore uses the
volume, where DCP reshards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nbtools._torch_compat import dtensor_shard_offset
from nbtools.checkpoint import _state
from nbtools.errors import CheckpointError

__all__ = ["MARK", "flatten", "is_marked", "meshes", "sharded", "unflatten"]

#: The skeleton's record of a DTensor: ``{MARK: spec, "local": local shard}``.
MARK = "__nbtools_dtensor__"

MeshKey = tuple[str, tuple[Any, ...], tuple[str, ...] | None]
#: A DTensor of the restoring models for each (mesh, placements) they use.
Known = dict[tuple[MeshKey, tuple[str, ...]], DTensor]


def is_marked(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor's record (see :func:`flatten`)."""
    return isinstance(obj, dict) and MARK in obj


def _mesh_key(mesh: Any) -> MeshKey:
    names = mesh.mesh_dim_names
    return (
        mesh.device_type,
        tuple(mesh.mesh.flatten().tolist()) + tuple(mesh.mesh.shape),
        tuple(names) if names is not None else None,
    )


#: Records already made, by mesh, placements, shape and stride (a snapshot of FSDP2 state
#: has three tensors per parameter, each step the same): at most this many are kept.
_SPECS_KEPT = 4096
_specs: dict[tuple[Any, ...], dict[str, Any]] = {}


def _spec(tensor: DTensor) -> dict[str, Any]:
    mesh = tensor.device_mesh
    key = (mesh, tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride()))
    try:
        return _specs[key]
    except (KeyError, TypeError):  # TypeError: a mesh that cannot be hashed
        pass
    coordinate = mesh.get_coordinate()
    spec = {
        "device": mesh.device_type,
        "mesh": mesh.mesh.tolist(),
        "names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None,
        "placements": [repr(p) for p in tensor.placements],
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "coordinate": list(coordinate) if coordinate is not None else None,
        "offset": dtensor_shard_offset(tensor),
    }
    try:
        if len(_specs) >= _SPECS_KEPT:
            _specs.clear()
        _specs[key] = spec
    except TypeError:
        pass
    return spec


def sharded(state: Any) -> bool:
    """Whether ``state`` (nested containers) holds a DTensor."""
    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(sharded(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(sharded(v) for v in state)
    return False


def _flat(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return {MARK: _spec(obj), "local": obj._local_tensor}
    if isinstance(obj, dict):
        return {k: _flat(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flat(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_flat(v) for v in obj)
    return obj


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each DTensor replaced by its record: its local shard (a plain
    tensor, the same memory) and what puts it back (see the module's docstring)."""
    return {k: v if k == _state.NS else _flat(v) for k, v in state.items()}


def meshes(models: Iterable[torch.nn.Module]) -> Known:
    """A DTensor of ``models`` for each mesh and placements they use: what a restore puts
    local shards back onto."""
    found: Known = {}
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            if isinstance(tensor, DTensor):
                key = (_mesh_key(tensor.device_mesh), tuple(repr(p) for p in tensor.placements))
                found.setdefault(key, tensor)
    return found


def _describe(spec: dict[str, Any]) -> str:
    names = f" ({', '.join(spec['names'])})" if spec.get("names") else ""
    return f"mesh {spec['mesh']}{names} with placements [{', '.join(spec['placements'])}]"


def _rebuild(record: dict[str, Any], name: str, known: Known, where: str) -> DTensor:
    spec, local = record[MARK], record["local"]
    mesh_list = torch.tensor(spec["mesh"])
    names = tuple(spec["names"]) if spec.get("names") is not None else None
    key = (
        (spec["device"], tuple(mesh_list.flatten().tolist()) + tuple(mesh_list.shape), names),
        tuple(spec["placements"]),
    )
    template = known.get(key)
    if template is None:
        now = sorted({_describe(_spec(t)) for t in known.values()})
        raise CheckpointError(
            f"{where} holds {name} sharded over {_describe(spec)}, which the models do "
            f"not use now ({'; '.join(now) or 'no DTensor'}): another mesh, so the "
            "volume is used, where DCP reshards"
        )
    mesh = template.device_mesh
    coordinate = mesh.get_coordinate()
    if spec["coordinate"] != (list(coordinate) if coordinate is not None else None):
        raise CheckpointError(
            f"{where} holds the shard of {name} at mesh coordinate {spec['coordinate']}, "
            f"and this rank sits at {coordinate} now: the volume is used, where DCP reshards"
        )
    return DTensor.from_local(
        local,
        mesh,
        template.placements,
        run_check=False,
        shape=torch.Size(spec["shape"]),
        stride=tuple(spec["stride"]),
    )


def _unflat(obj: Any, path: tuple[Any, ...], known: Known, where: str) -> Any:
    if is_marked(obj):
        return _rebuild(obj, ".".join(str(p) for p in path), known, where)
    if isinstance(obj, dict):
        return {k: _unflat(v, (*path, k), known, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflat(v, (*path, i), known, where) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_unflat(v, (*path, i), known, where) for i, v in enumerate(obj))
    return obj


def unflatten(state: dict[str, Any], known: Known, where: str) -> dict[str, Any]:
    """``state`` (decoded) with each DTensor record put back as a DTensor over its local
    shard (the same memory), on the mesh the restoring models use (``known``, see
    :func:`meshes`).

    Raises:
        CheckpointError: The models use no such mesh and placements now, or this rank
            sits elsewhere in it (another mesh at the same world size): the volume must
            be used, where DCP reshards.
    """
    return {k: v if k == _state.NS else _unflat(v, (k,), known, where) for k, v in state.items()}
