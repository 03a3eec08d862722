"""``VolumeWriter``: a DCP storage writer that stages locally, uploads, verifies, publishes.

Each rank writes its shards to a private local staging directory, uploads them
to the target in parallel, checks what arrived (size, and the CRC-32 recorded
for every item), and removes the staged files. Only after every rank has done
so does the coordinator publish ``.metadata``, atomically where the target
allows it. The file layout is PyTorch's own (``__<rank>_<n>.distcp`` plus
``.metadata``), so ``FileSystemReader`` loads the result.

With ``dcp.save(..., use_collectives=False)`` (DCP's rank-local mode) each rank
plans, writes and publishes alone, as ``FileSystemWriter`` does: its files are
``__<rank>_<n>.distcp`` and its metadata ``__<rank>.metadata``, published after
its own files; no ``.metadata`` is written and no rank touches another's files.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from nbtools._internal.fs import TMP_PREFIX
from nbtools._internal.log import get_logger
from nbtools.checkpoint import _staging
from nbtools.checkpoint._layout import (
    METADATA_NAME,
    RANK_METADATA_RE,
    is_shard,
    rank_metadata_name,
    shard_name,
    shard_prefix,
)
from nbtools.checkpoint._shards import (
    file_writer,
    item_writer,
    new_writer_token,
    verify_items,
    write_shard,
)
from nbtools.checkpoint._target import Target, can_open, open_target
from nbtools.errors import CheckpointError

__all__ = ["VolumeWriter"]

_log = get_logger("checkpoint")
# Estimated size of a non-tensor item, for the staging space check.
_BYTES_ITEM_ESTIMATE = 64 << 10


def _item_bytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return _BYTES_ITEM_ESTIMATE
    numel = 1
    for dim in item.tensor_data.size:
        numel *= dim
    return numel * item.tensor_data.properties.dtype.itemsize + 1024


def _split(items: list[Any], bins: int) -> list[list[Any]]:
    """Spread items over ``bins`` files, largest first, each onto the lightest file."""
    buckets: list[list[Any]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for item in sorted(items, key=_item_bytes, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += _item_bytes(item)
    return [b for b in buckets if b]


@dataclasses.dataclass
class _Prefix:
    prefix: str


class VolumeWriter(StorageWriter):
    """DCP ``StorageWriter`` for a local or mounted directory or an fsspec URL.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save({"model": model.state_dict()},  # doctest: +SKIP
        ...          storage_writer=VolumeWriter("/mnt/vol/run1/step_100"))

    Args:
        path: Checkpoint directory: a path (local, NFS, FUSE) or a URL such as
            ``s3://bucket/run1/step_100``. It must not already hold a complete
            checkpoint (a ``.metadata``, or in rank-local mode this rank's
            ``__<rank>.metadata``); stale files of an interrupted save are removed.
        staging_dir: Local directory for staged shards; default ``NBTOOLS_STAGING_DIR``
            or the system temp dir.
        thread_count: Shard files written and uploaded in parallel per rank.
        sync_files: fsync uploaded files on local and mounted targets before publishing.
        verify: Re-read every uploaded (copied) file and compare item checksums.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Target,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        thread_count: int = 2,
        sync_files: bool = True,
        verify: bool = True,
    ) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        self._open(path)
        self._staging_base = _staging.staging_base(staging_dir)
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.verify = verify
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True

    def _open(self, path: str | os.PathLike[str] | Target) -> None:
        self._target: Target = open_target(path)
        self.path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else self._target.url
        if self._target.isfile():
            raise ValueError(f"checkpoint path {self.path} is a file; give a directory path")

    # --- StorageWriter protocol ----------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._open(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def _refuse_complete(self, names: list[str] | None = None) -> None:
        """Raise when a complete checkpoint is here.

        Only files no rank of this save can have published yet are looked at, so
        every rank decides alike: ``.metadata`` always, in rank-local mode this
        rank's own ``__<rank>.metadata``, and with ``names`` (the directory listing,
        on the coordinator) any rank's.
        """
        found = None
        if self._target.exists(METADATA_NAME):
            found = METADATA_NAME
        elif not self.use_collectives and self._target.exists(rank_metadata_name(self.rank)):
            found = rank_metadata_name(self.rank)
        elif names is not None:
            found = next((n for n in sorted(names) if RANK_METADATA_RE.match(n)), None)
        if found is not None:
            raise CheckpointError(
                f"Checkpoint already exists: {self.path} already holds a complete checkpoint "
                f"({found}); refusing to write into it (a new save there could mix with the "
                "old one). Save to a new directory, or delete the old checkpoint first"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._refuse_complete()
        try:
            self._target.makedirs()
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {self.path}: {exc}") from exc
        if not self.use_collectives:
            # Rank-local: no coordinator clears the directory, so each rank clears only
            # what an interrupted save left under its own prefix, and names its files.
            prefix = shard_prefix(self.rank)
            for name in self._target.listdir():
                if is_shard(name, prefix):
                    self._target.remove_file(name)
            plan = dataclasses.replace(plan, storage_data=_Prefix(prefix))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self.use_collectives:  # this rank's own plan, already named
            return plans
        # Runs on the coordinator before any rank writes: the only safe moment to
        # clear what an interrupted save left here.
        names = self._target.listdir()
        self._refuse_complete(names)
        for name in names:
            if is_shard(name) or name.startswith(TMP_PREFIX):
                self._target.remove_file(name)
        return [
            dataclasses.replace(plan, storage_data=_Prefix(shard_prefix(i)))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = (
            plan.storage_data.prefix if plan.storage_data is not None else shard_prefix(self.rank)
        )
        token = new_writer_token()
        buckets = _split(list(plan.items), self.thread_count)
        needed = sum(_item_bytes(i) for i in plan.items)
        _staging.check_space(self._staging_base, needed, f"saving {self.path}")
        fut: Future[list[WriteResult]] = Future()
        with _staging.staging_area(self._staging_base) as stage:
            move = self._target.same_filesystem(stage)
            bar = _staging.progress(needed, "checkpoint upload", self.is_coordinator)
            try:
                with ThreadPoolExecutor(
                    len(buckets) or 1, thread_name_prefix="nbtools-ckpt-io"
                ) as pool:
                    jobs = [
                        pool.submit(
                            self._write_one,
                            stage,
                            shard_name(prefix, n),
                            bucket,
                            planner,
                            move,
                            bar,
                            token,
                        )
                        for n, bucket in enumerate(buckets)
                    ]
                    results = [r for job in jobs for r in job.result()]
            finally:
                bar.close()
        fut.set_result(results)
        return fut

    def _write_one(
        self,
        stage: str,
        name: str,
        items: list[Any],
        planner: Any,
        move: bool,
        bar: Any,
        token: str,
    ) -> list[WriteResult]:
        local = os.path.join(stage, name)
        with open(local, "wb") as fh:
            # A file moved into place is the final one: its fsync can start while writing.
            results = write_shard(
                fh, name, items, planner, writeback=move and self.sync_files, token=token
            )
        size = os.path.getsize(local)
        self._target.upload(local, name, fsync=self.sync_files, move=move)
        uploaded = self._target.size(name)
        if uploaded != size:
            raise CheckpointError(
                f"upload of {name} to {self.path} is incomplete ({uploaded} of {size} bytes)"
            )
        if self.verify and not move:
            with self._target.open_read(name) as fh:
                verify_items(fh, [r.storage_data for r in results], f"upload to {self.path}")
        if not move:
            os.unlink(local)
        bar.update(size)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = "1.0.0"
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        #: Bytes of every shard item of this save (what the ``checkpoint_saved`` event reports).
        self.saved_bytes = sum(int(getattr(info, "length", 0) or 0) for info in storage_md.values())
        self._check_files_kept(storage_md.values())
        data = pickle.dumps(metadata)
        if self.sync_files:
            self._target.sync_dir()
        name = METADATA_NAME if self.use_collectives else rank_metadata_name(self.rank)
        self._target.publish_bytes(name, data)
        _log.info("checkpoint published: %s/%s", self.path, name)

    def _check_files_kept(self, infos: Any) -> None:
        """Raise unless every shard file still is the one this save wrote.

        Another save writing into the same directory with the same file names (two
        writers, or rank-local saves whose ranks collide) replaces or removes
        files; publishing then would report data as saved that is gone.
        """
        tokens: dict[str, str | None] = {}
        for info in infos:
            tokens.setdefault(info.relative_path, item_writer(info))

        def check(name: str) -> str | None:
            expected = tokens[name]
            if expected is None:
                return None
            try:
                with self._target.open_read(name) as fh:
                    found = file_writer(fh)
            except FileNotFoundError:
                return f"{name} was removed"
            return None if found == expected else f"{name} was written again by another save"

        with ThreadPoolExecutor(self.thread_count, thread_name_prefix="nbtools-ckpt-io") as pool:
            problems = [p for p in pool.map(check, sorted(tokens)) if p]
        if problems:
            raise CheckpointError(
                f"save to {self.path} lost data before it could publish: {problems[0]}"
                f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}. Another "
                "save wrote into the same directory at the same time, or file prefixes "
                "collided (use_collectives=False or no_dist=True on several processes that "
                "share a rank number). Give every save its own directory"
            )

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when nbtools can write a checkpoint there: a local or mounted path whose
        nearest existing ancestor is a writable directory, or a URL of an installed fsspec
        protocol."""
        return can_open(checkpoint_id, write=True)
