"""``VolumeReader``: a DCP storage reader that verifies before it loads.

Metadata is read with a restricted unpickler. Where the target is remote (a
URL, a network or FUSE mount) the byte ranges of the items a rank's plan names
are fetched into local staging (one directory per node, shared by its ranks),
each range several ranks need by one rank only
and handed to the others over the process group, checked against its recorded
CRC-32 where it was fetched (:mod:`nbtools.checkpoint._storage._staged_read`); a handed
tensor whose destination is a dense CPU tensor of its dtype and shape is copied
from the message straight into it (:mod:`nbtools.checkpoint._storage._delivery`). A
local directory is read in place, each item checked as it is read. Only
verified bytes are loaded. Non-tensor values are checked to
be loadable with ``torch.load(weights_only=True)`` before DCP's planner
unpickles them. Loading with another world size works as with any DCP reader.

Rank-local checkpoints (``dcp.save(..., use_collectives=False)``) have one
``__<rank>.metadata`` per rank and no ``.metadata``; DCP asks for them with
``read_metadata(rank=...)``, as from ``FileSystemReader``. Items written through
stream extensions (``FileSystemWriter(_extensions=[ZStandard()])``) are decoded
through PyTorch's extension registry.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from nbtools import _torch_compat
from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage import (
    METADATA_NAME,
    NOTE,
    Delivery,
    Slice,
    StagedFetch,
    StreamTransforms,
    Target,
    Timings,
    can_open,
    check_rank_local,
    check_weights_only,
    dense_destination,
    descriptors_of,
    item_checksum,
    open_target,
    rank_metadata_name,
    read_item_into,
    read_metadata,
    saved_data,
    scratch,
    verify_items,
)
from nbtools.errors import CorruptCheckpointError

__all__ = ["VolumeReader", "read_metadata"]

_log = get_logger("checkpoint")


def _writable_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class VolumeReader(StorageReader):
    """DCP ``StorageReader`` for a local or mounted directory or an fsspec URL.

    Example:
        >>> import torch
        >>> import torch.distributed.checkpoint as dcp
        >>> model = torch.nn.Linear(4, 2)
        >>> sd = {"model": model.state_dict()}
        >>> dcp.load(sd, storage_reader=VolumeReader("/mnt/vol/run1/step_100"))  # doctest: +SKIP

    Args:
        path: Checkpoint directory (path or URL) holding ``.metadata``.
        staging_dir: Local directory for downloaded shards; default
            ``NBTOOLS_STAGING_DIR`` or the system temp dir.
        stage: Download to local staging before reading. None: only for network
            or FUSE mounts. URLs are always staged.
        thread_count: Ranged reads (and verifications) run in parallel per rank.
        verify: Check item checksums before loading (checkpoints written by
            PyTorch's ``FileSystemWriter`` carry none and load unchecked).
        read_once: Where files are staged, fetch each stored range that several
            ranks need on one rank only and hand it to the others over the
            process group (False: every rank fetches all it needs itself).
        process_group: The group of the ranks loading (the one given to
            ``dcp.load``); None: the default group.
        chunk_size: The size of the parallel ranged pieces a large item a rank
            needs alone is fetched in (default 64 MiB). Ranges handed over are
            fetched and broadcast in messages of a quarter chunk, several in
            flight in buffers of two chunks in all.
        min_chunk_size: No ranged piece or message is smaller (default 8 MiB).
        read_timeout: Seconds a fetch may go without receiving a byte before
            the load fails on every rank (default 600).
        _extension_registry: A ``torch.distributed.checkpoint._extension.ExtensionRegistry``
            to decode stream extensions with, as ``FileSystemReader`` takes it;
            None: PyTorch's default registry (``ZStandard``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Target,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        stage: bool | None = None,
        thread_count: int = 4,
        verify: bool = True,
        read_once: bool = True,
        process_group: Any = None,
        chunk_size: int = 64 << 20,
        min_chunk_size: int = 8 << 20,
        read_timeout: float = 600.0,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__()
        if chunk_size <= 0 or min_chunk_size <= 0 or min_chunk_size > chunk_size:
            raise ValueError(
                f"chunk_size ({chunk_size}) and min_chunk_size ({min_chunk_size}) must be "
                "positive, min_chunk_size no larger than chunk_size"
            )
        if not read_timeout > 0:
            raise ValueError(
                f"read_timeout must be a positive number of seconds, not {read_timeout}"
            )
        self._fetch_settings = dict(
            read_once=read_once,
            process_group=process_group,
            chunk_size=int(chunk_size),
            min_chunk_size=int(min_chunk_size),
            read_timeout=float(read_timeout),
        )
        self._staging_base = scratch.staging_base(staging_dir)
        self._stage_choice = stage
        self._open(path)
        self.thread_count = self._fetch.thread_count = max(1, thread_count)
        self.verify = self._fetch.verify = verify
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        self.is_coordinator = True
        self.rank: int | None = None
        self.use_collectives = True
        self._transforms = StreamTransforms(_extension_registry)

    def _open(self, path: str | os.PathLike[str] | Target) -> None:
        self._target: Target = open_target(path)
        self.path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else self._target.url
        # Where files cannot be opened in place (object stores) they are always staged.
        self._local_dir = self._target.local_path
        self._stage = self._local_dir is None or (
            self._target.remote if self._stage_choice is None else self._stage_choice
        )
        self._fetch = StagedFetch(
            self._target,
            self.path,
            thread_count=getattr(self, "thread_count", 4),
            verify=getattr(self, "verify", True),
            staging_base=self._staging_base,
            **self._fetch_settings,
        )
        # dcp.load wraps what is raised inside it: only a check made here leads the error.
        check_rank_local(self._target, self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self._open(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_NAME if rank is None else rank_metadata_name(rank)
        self._fetch.timings = timings = Timings()
        with timings.phase("metadata"):
            metadata = read_metadata(self._target, self.path, name)
        self._mark = time.perf_counter()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self._tensors = dict(getattr(metadata, "state_dict_metadata", None) or {})
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        if self.storage_data is None:
            raise CorruptCheckpointError(f"{self.path}/{METADATA_NAME} has no storage data")
        self._transforms.check(self.storage_data.values(), self.path)
        self._fetch.thread_count, self._fetch.verify = self.thread_count, self.verify
        self._fetch.set_up(self.storage_data, self.use_collectives)

    def _since_mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._fetch.timings.add(phase, now - getattr(self, "_mark", now))
        self._mark = now

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self._since_mark("local_plan")
        return self._fetch.local_note(plan) if self._stage else plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._fetch.global_notes(plans) if self._stage else plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._since_mark("global_plan")
        timings = self._fetch.timings
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        if self._stage:
            note = plan.storage_data.get(NOTE) if isinstance(plan.storage_data, dict) else None
            area = (note or {}).get("area")
            with (
                scratch.shared_area(self._staging_base, area)
                if area
                else scratch.staging_area(self._staging_base)
            ) as stage:
                delivery = Delivery(
                    plan,
                    self.storage_data,
                    self._tensors,
                    planner,
                    lambda name, stage=stage: os.path.join(stage, name),
                )
                # Checksums are verified where the bytes are fetched, not again here.
                self._fetch.run(plan, note or {}, planner, stage, delivery)
                left = {
                    name: [i for i in items if id(i) not in delivery.delivered]
                    for name, items in per_file.items()
                }
                with timings.phase("load"):
                    self._load_all(
                        {n: items for n, items in left.items() if items},
                        planner,
                        stage,
                        verify=False,
                    )
        else:
            assert self._local_dir is not None  # no local directory means always staged
            with timings.phase("load"):
                self._load_all(per_file, planner, self._local_dir, verify=self.verify)
        timings.mark("loaded_at")
        _log.debug("loaded %s on rank %s: %s", self.path, self.rank, timings.text())
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _load_all(
        self, per_file: dict[str, list[Any]], planner: LoadPlanner, where: str, verify: bool
    ) -> None:
        def local_path(name: str) -> str:
            return os.path.join(where, name)

        def check(name: str, info: Any) -> None:
            with open(local_path(name), "rb") as fh:
                verify_items(fh, [info], self.path)

        def offset(item: Any) -> int:
            return self.storage_data[item.storage_index].offset

        # Verifying and direct reads run on worker threads, planned item by item in file
        # order. A tensor whose destination is a matching contiguous CPU tensor is read
        # straight into it, its checksum computed as it arrives (no intermediate copy);
        # any other item is verified before this thread loads it. Planner calls stay here.
        with (
            ThreadPoolExecutor(self.thread_count, thread_name_prefix="nbtools-ckpt-io") as pool,
            contextlib.ExitStack() as files,
        ):
            jobs: list[Any] = []
            checks: dict[tuple[str, int], Any] = {}
            try:
                plan: list[tuple[Any, Any, Any]] = []
                for name, items in per_file.items():
                    with open(local_path(name), "rb") as fh:
                        for item in sorted(items, key=offset):
                            info = self.storage_data[item.storage_index]
                            direct = (
                                None if descriptors_of(info) else self._direct(fh, item, planner)
                            )
                            if direct is not None:
                                target, at = direct
                                job = pool.submit(
                                    read_item_into,
                                    local_path(name),
                                    info,
                                    at,
                                    _writable_view(target),
                                    verify,
                                    self.path,
                                )
                            elif verify and item_checksum(info) is not None:
                                # Items read in parts (resharding) are verified once.
                                key = (name, info.offset)
                                if key not in checks:
                                    checks[key] = pool.submit(check, name, info)
                                    jobs.append(checks[key])
                                job, target = checks[key], None
                            else:
                                job, target = None, None
                            plan.append((item, job, target))
                            if direct is not None:
                                jobs.append(job)
                handles: dict[str, Any] = {}
                for item, job, target in plan:
                    if job is not None:
                        job.result()
                    if target is not None:
                        planner.commit_tensor(item, target)
                    else:
                        name = self.storage_data[item.storage_index].relative_path
                        if name not in handles:
                            handles[name] = files.enter_context(open(local_path(name), "rb"))
                        self._load_item(handles[name], item, planner)
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise

    def _direct(self, fh: Any, item: Any, planner: LoadPlanner) -> tuple[torch.Tensor, int] | None:
        """The destination of a tensor item and the file offset of its data, when the saved
        bytes can be read straight into it (whole item, same dtype and shape, both dense
        and contiguous on CPU, native byte order); else None."""
        if item.type != LoadItemType.TENSOR:
            return None
        info = self.storage_data[item.storage_index]
        found = saved_data(fh, info.offset, info.length)
        if found is None:
            return None
        saved, at = found
        if any(item.storage_offsets) or tuple(item.lengths) != tuple(saved.shape):
            return None
        target = planner.resolve_tensor(item).detach()
        if not dense_destination(target, saved.dtype, saved.shape):
            return None
        return target, info.offset + at

    def _load_item(self, fh: Any, item: Any, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        where = f"{self.path}: {item.storage_index.fqn}"
        raw = Slice(fh, info.offset, info.length)
        stream: Any = raw
        if descriptors_of(info):
            stream = io.BytesIO(self._transforms.read_all(raw, info, where))
        if item.type == LoadItemType.BYTE_IO:
            data = stream.read()
            check_weights_only(data, where)
            planner.load_bytes(item, io.BytesIO(data))
            return
        try:
            tensor = torch.load(stream, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {item.storage_index.fqn} cannot be read ({exc})"
            ) from exc
        tensor = _torch_compat.narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{self.path}: {item.storage_index.fqn} has shape {tuple(tensor.size())} in the "
                f"checkpoint but {tuple(target.size())} in the state to load into"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when nbtools can read a checkpoint there: a local or mounted directory it
        may read (or a path not created yet below a directory), or a URL of an installed
        fsspec protocol."""
        return can_open(checkpoint_id, write=False)
