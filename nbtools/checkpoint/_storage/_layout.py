"""The names of a checkpoint root: ``ROOT/step_<N>/`` holding PyTorch's DCP files.

Every module that names or recognises a file or directory of a checkpoint asks
here, so the layout is written down once:

- ``step_<N>``: the checkpoint of step N (N the last completed step);
- ``.metadata``: DCP's metadata, published last (its presence means complete);
- ``__<rank>.metadata``: per-rank metadata of rank-local saves
  (``dcp.save(..., use_collectives=False)``);
- ``__<rank>_<n>.distcp``: shard files, as ``FileSystemWriter`` names them;
- ``__<rank>_<n>.<tag>.distcp``: shard files of a save into a directory that
  still holds other files (a complete checkpoint it replaces): the tag is the
  save's own, so no file of the checkpoint being replaced is written over;
- ``.nbtools-saving-<tag>``: the marker of a save in progress (who writes).

Readers find every file through the metadata (DCP records each item's file),
so the names of shard files are the writer's choice.

Steps are never parsed back out of paths or URLs: code that found a checkpoint
keeps its step.
"""

from __future__ import annotations

import re

__all__ = [
    "METADATA_NAME",
    "RANK_METADATA_RE",
    "rank_metadata_name",
    "step_dir_name",
    "parse_step_dir",
    "shard_prefix",
    "shard_name",
    "is_shard",
    "SAVE_MARK_PREFIX",
    "save_mark_name",
    "save_mark_tag",
]

METADATA_NAME = ".metadata"
#: Names of the per-rank metadata files of rank-local (``use_collectives=False``) saves.
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
_STEP_RE = re.compile(r"^step_(\d+)$")
_SHARD_SUFFIX = ".distcp"
#: Prefix of the marker a save in progress keeps in its checkpoint directory.
SAVE_MARK_PREFIX = ".nbtools-saving-"


def rank_metadata_name(rank: int) -> str:
    """The metadata file a rank publishes in rank-local mode, as ``FileSystemWriter`` names it."""
    return f"__{rank}{METADATA_NAME}"


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step_{step}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory entry named like a checkpoint (``step_<N>``), else None."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def shard_prefix(rank: int) -> str:
    """The prefix of the shard files one rank writes (``__<rank>_``)."""
    return f"__{rank}_"


def shard_name(prefix: str, index: int, tag: str = "") -> str:
    """The name of shard file ``index`` of the writer whose files start with ``prefix``.

    With ``tag``, the name carries it (``__0_1.<tag>.distcp``): files of one save only.
    """
    return f"{prefix}{index}{'.' + tag if tag else ''}{_SHARD_SUFFIX}"


def is_shard(name: str, prefix: str = "") -> bool:
    """True for a shard file name (of the writer whose files start with ``prefix``)."""
    return name.startswith(prefix) and name.endswith(_SHARD_SUFFIX)


def save_mark_name(tag: str) -> str:
    """The marker file of the save whose tag is ``tag``."""
    return f"{SAVE_MARK_PREFIX}{tag}"


def save_mark_tag(name: str) -> str | None:
    """The tag of a save marker's file name, else None."""
    return name[len(SAVE_MARK_PREFIX) :] if name.startswith(SAVE_MARK_PREFIX) else None
