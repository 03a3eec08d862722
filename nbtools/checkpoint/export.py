"""Exporting model weights from a checkpoint to one ``torch.save`` file."""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from nbtools._internal.fs import atomic_write
from nbtools.checkpoint import _state
from nbtools.checkpoint._dcp import quiet_single_process_warning, unwrap
from nbtools.checkpoint._storage import METADATA_NAME
from nbtools.checkpoint.discovery import candidates, root_target, validate
from nbtools.checkpoint.reader import VolumeReader
from nbtools.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["export"]


def export(
    path: str | os.PathLike[str], out_file: str | os.PathLike[str], *, model: str | None = None
) -> str:
    """Write the model weights of a checkpoint to ``out_file`` with ``torch.save``.

    Example:
        >>> export("/mnt/vol/run1/checkpoints", "model.pt")  # doctest: +SKIP
        >>> net.load_state_dict(torch.load("model.pt"))  # doctest: +SKIP

    Args:
        path: A checkpoint directory (``.../step_N``) or a root (its newest checkpoint).
        out_file: Local file to write (atomically).
        model: Which saved model; default: the only one. With several and none
            chosen, the file maps each model name to its weights.

    Returns:
        The checkpoint directory exported.
    """
    target = root_target(path)
    if not target.exists(METADATA_NAME):
        found = next(candidates(target), None)
        if found is None:
            raise CheckpointNotFoundError(f"no complete checkpoint at or under {target.url}")
        _, target, metadata = found
    else:
        metadata = validate(target, target.url)
    quiet_single_process_warning()
    try:
        blob_state = _state.blob_template(metadata, 0)
        dcp.load(blob_state, storage_reader=VolumeReader(target), no_dist=True)
        kinds = torch.load(
            io.BytesIO(next(iter(blob_state[_state.NS].values()))), weights_only=True
        )["kinds"]
    except BaseException as exc:  # noqa: BLE001 - re-raised as the error unwrap makes of it
        raise unwrap(exc, f"reading {target.url}") from None
    models = sorted(n for n, k in kinds.items() if k == "model")
    if model is not None:
        if model not in models:
            raise ValueError(f"{target.url} has no model {model!r}; saved models: {models}")
        models = [model]
    if not models:
        raise CheckpointError(f"{target.url} holds no model weights (saved: {sorted(kinds)})")
    state: dict[str, Any] = {name: {} for name in models}
    for key, md in metadata.state_dict_metadata.items():
        name, _, rest = key.partition(".")
        if name in state:
            state[name][rest] = (
                torch.empty(md.size, dtype=md.properties.dtype)
                if isinstance(md, TensorStorageMetadata)
                else b""
            )
    try:
        dcp.load(state, storage_reader=VolumeReader(target), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - re-raised as the error unwrap makes of it
        raise unwrap(exc, f"reading {target.url}") from None
    out = state[models[0]] if len(models) == 1 else state
    with atomic_write(os.fspath(out_file), "wb") as fh:
        torch.save(out, fh)
    return target.url
