"""``VolumeWriter``: a DCP storage writer that stages locally, uploads, verifies, publishes.

Each rank writes its shards to a private local staging directory, uploads them
to the target in parallel, checks what arrived (size, and the CRC-32 recorded
for every item), and removes the staged files. Only after every rank has done
so does the coordinator publish ``.metadata``, atomically where the target
allows it. The file layout is PyTorch's own (``__<rank>_<n>.distcp`` plus
``.metadata``), so ``FileSystemReader`` loads the result.

Saving into a directory that holds a complete checkpoint replaces it: the new
shards get names of their own (``__<rank>_<n>.<tag>.distcp``) next to the old
ones, the new ``.metadata`` replaces the old in one atomic step (a rename; one
PUT on object stores), and only then are the old shards removed. At every
moment the directory holds one complete checkpoint, old or new. A marker
(``.nbtools-saving-<tag>``, see ``_storage._save_markers``) says which save writes, so a second
save into the same directory at the same time is refused and files left by a
killed save are removed by the next one.

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

from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage import (
    METADATA_NAME,
    Target,
    can_open,
    file_writer,
    is_shard,
    item_writer,
    new_writer_token,
    open_target,
    rank_metadata_name,
    save_markers,
    scratch,
    shard_name,
    shard_prefix,
    verify_items,
    write_shard,
)
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
    tag: str = ""  # names the files apart from those already in the directory


class VolumeWriter(StorageWriter):
    """DCP ``StorageWriter`` for a local or mounted directory or an fsspec URL.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save({"model": model.state_dict()},  # doctest: +SKIP
        ...          storage_writer=VolumeWriter("/mnt/vol/run1/step_100"))

    Args:
        path: Checkpoint directory: a path (local, NFS, FUSE) or a URL such as
            ``s3://bucket/run1/step_100``. A complete checkpoint already there is
            replaced atomically (the directory holds the old one until the new
            ``.metadata`` is published); files of an interrupted save are removed.
            Refused: another save writing there at the same time, and in rank-local
            mode (``use_collectives=False``) a directory holding a complete checkpoint,
            whose per-rank metadata cannot be replaced all at once.
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
        self._staging_base = scratch.staging_base(staging_dir)
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.verify = verify
        self.save_id = str(uuid.uuid4())
        self._tag = uuid.uuid4().hex[:16]
        self._marked = False
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
        self._tag = uuid.uuid4().hex[:16]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def _refuse_rank_local(self, rank_local: list[str] | None = None) -> None:
        """Raise where a save would mix with a complete checkpoint it cannot replace.

        Rank-local mode: this rank's ``__<rank>.metadata`` or a ``.metadata``. Each rank
        publishes alone there, so no single step swaps the whole checkpoint. Collective
        mode, on the coordinator: the rank-local metadata files of its listing.
        """
        found = None
        if rank_local is not None:
            found = min(rank_local, default=None)
        elif self._target.exists(METADATA_NAME):
            found = METADATA_NAME
        elif self._target.exists(rank_metadata_name(self.rank)):
            found = rank_metadata_name(self.rank)
        if found is not None:
            raise CheckpointError(
                f"Checkpoint already exists: {self.path} already holds a complete checkpoint "
                f"({found}) that this save cannot replace: rank-local saves "
                "(use_collectives=False) publish one metadata file per rank, so a kill "
                "between two ranks would leave the ranks of two saves mixed. Save to a new "
                "directory, delete the old checkpoint first, or save with collectives (the "
                "default), which replaces a complete checkpoint atomically"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.use_collectives:
            self._refuse_rank_local()
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
        # On the coordinator before any rank writes. The marker goes first, so of two
        # saves starting together at least one sees the other's.
        save_markers.begin(self._target, self._tag)
        self._marked = True
        try:
            found = save_markers.survey(self._target, self._tag)
            self._refuse_rank_local(found.rank_local)
            save_markers.refuse_live(found, self.path)
            keep = None if found.others_writing else save_markers.metadata_files(self._target)
            if keep is not None:  # what an interrupted save left goes now
                save_markers.sweep(self._target, found, keep)
            # PyTorch's own names where no file stays; names of this save's own next to
            # files that do (the checkpoint being replaced, another machine's save) or
            # that a metadata names, even one that cannot be read.
            tag = "" if keep == set() else self._tag
        except BaseException:
            self._unmark()
            raise
        return [
            dataclasses.replace(plan, storage_data=_Prefix(shard_prefix(i), tag))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def _unmark(self) -> None:
        if self._marked:
            self._marked = False
            save_markers.end(self._target, self._tag)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        names = (
            plan.storage_data if plan.storage_data is not None else _Prefix(shard_prefix(self.rank))
        )
        token = new_writer_token()
        buckets = _split(list(plan.items), self.thread_count)
        needed = sum(_item_bytes(i) for i in plan.items)
        try:
            results = self._write_all(names, buckets, needed, planner, token)
        except BaseException:
            self._unmark()  # this save ends here; the next one need not wonder about it
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_all(
        self, names: _Prefix, buckets: list[list[Any]], needed: int, planner: Any, token: str
    ) -> list[WriteResult]:
        scratch.check_space(self._staging_base, needed, f"saving {self.path}")
        with scratch.staging_area(self._staging_base) as stage:
            move = self._target.same_filesystem(stage)
            bar = scratch.progress(needed, "checkpoint upload", self.is_coordinator)
            try:
                with ThreadPoolExecutor(
                    len(buckets) or 1, thread_name_prefix="nbtools-ckpt-io"
                ) as pool:
                    jobs = [
                        pool.submit(
                            self._write_one,
                            stage,
                            shard_name(names.prefix, n, names.tag),
                            bucket,
                            planner,
                            move,
                            bar,
                            token,
                            needed,
                        )
                        for n, bucket in enumerate(buckets)
                    ]
                    results = [r for job in jobs for r in job.result()]
            finally:
                bar.close()
        return results

    def _write_one(
        self,
        stage: str,
        name: str,
        items: list[Any],
        planner: Any,
        move: bool,
        bar: Any,
        token: str,
        needed: int,
    ) -> list[WriteResult]:
        local = os.path.join(stage, name)
        try:
            with open(local, "wb") as fh:
                # A file moved into place is the final one: its fsync can start while writing.
                results = write_shard(
                    fh, name, items, planner, writeback=move and self.sync_files, token=token
                )
        except (OSError, RuntimeError) as exc:
            staged = scratch.used_bytes(stage)
            full = scratch.space_error(
                exc,
                self._staging_base,
                max(needed, staged),
                f"rank {self.rank} saving {self.path}",
            )
            if full is None:
                raise
            raise full from exc
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
        try:
            self._finish(metadata, results)
        finally:
            self._unmark()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
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
        if not self.use_collectives:
            self._target.publish_bytes(rank_metadata_name(self.rank), data)
            _log.info("checkpoint published: %s/%s", self.path, rank_metadata_name(self.rank))
            return
        replaced = save_markers.metadata_files(self._target)
        # The one step that swaps checkpoints: before it the old one is complete, after
        # it the new one (its shards are all uploaded and durable by now).
        self._target.publish_bytes(METADATA_NAME, data)
        _log.info("checkpoint published: %s/%s", self.path, METADATA_NAME)
        self._remove_unused({info.relative_path for info in storage_md.values()}, replaced)

    def _remove_unused(self, published: set[str], replaced: set[str] | None) -> None:
        """After publishing: remove the shards of the checkpoint replaced, and leftovers.

        A failure here loses nothing (the new checkpoint is complete); what stays is
        removed by the next save into this directory.
        """
        try:
            found = save_markers.survey(self._target, self._tag)
            if found.others_writing:  # only what the replaced checkpoint used
                for name in sorted((replaced or set()) - published):
                    self._target.remove_file(name)
                return
            keep = save_markers.metadata_files(
                self._target
            )  # another save may have published since
            if keep is not None:
                removed = save_markers.sweep(self._target, found, keep)
                if removed and replaced:
                    _log.info("replaced the checkpoint in %s", self.path)
        except OSError as exc:
            _log.warning("could not remove the replaced files in %s: %s", self.path, exc)

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
