"""``VolumeReader``: a DCP storage reader that verifies before it loads.

Metadata is read with a restricted unpickler. Each rank fetches the shard files
it needs (in parallel, into local staging when the target is remote: a URL or
a network/FUSE mount; in place otherwise), checks every needed item against
its recorded CRC-32, and only then loads it. Non-tensor values are checked to
be loadable with ``torch.load(weights_only=True)`` before DCP's planner
unpickles them. Loading with another world size works as with any DCP reader.
"""

from __future__ import annotations

import io
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from nbtools.checkpoint import _staging
from nbtools.checkpoint._safe_pickle import check_weights_only, load_metadata
from nbtools.checkpoint._shards import verify_items
from nbtools.checkpoint._target import LocalTarget, open_target
from nbtools.checkpoint.writer import METADATA_NAME
from nbtools.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["VolumeReader", "read_metadata"]


def read_metadata(target: Any, where: str) -> Metadata:
    """Read and safely unpickle ``.metadata`` of a checkpoint directory target."""
    try:
        data = target.read_bytes(METADATA_NAME)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{where} has no {METADATA_NAME}: it is not a complete checkpoint"
        ) from None
    return load_metadata(data, f"{where}/{METADATA_NAME}")


class _Slice(io.RawIOBase):
    """A seekable read-only window ``[offset, offset + length)`` of an open file."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._len, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), self._len - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n])
        self._pos += got
        return got


class VolumeReader(StorageReader):
    """DCP ``StorageReader`` for a local or mounted directory or an fsspec URL.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> sd = {"model": model.state_dict()}
        >>> dcp.load(sd, storage_reader=VolumeReader("/mnt/vol/run1/step_100"))  # doctest: +SKIP

    Args:
        path: Checkpoint directory (path or URL) holding ``.metadata``.
        staging_dir: Local directory for downloaded shards; default
            ``NBTOOLS_STAGING_DIR`` or the system temp dir.
        stage: Download to local staging before reading. None: only for network
            or FUSE mounts. URLs are always staged.
        thread_count: Files downloaded and verified in parallel.
        verify: Check item checksums before loading (checkpoints written by
            PyTorch's ``FileSystemWriter`` carry none and load unchecked).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        stage: bool | None = None,
        thread_count: int = 2,
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._target = open_target(self.path)
        self._staging_base = _staging.staging_base(staging_dir)
        # fsspec targets are always read through staging (no local path to read in place).
        local = isinstance(self._target, LocalTarget)
        self._stage = not local or (self._target.remote if stage is None else stage)
        self.thread_count = max(1, thread_count)
        self.verify = verify
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        self.is_coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self._target = open_target(self.path)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._target, self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        if self.storage_data is None:
            raise CorruptCheckpointError(f"{self.path}/{METADATA_NAME} has no storage data")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        if self._stage:
            needed = sum(self._target.size(name) for name in per_file)
            _staging.check_space(self._staging_base, needed, f"loading {self.path}")
            with _staging.staging_area(self._staging_base) as stage:
                self._fetch_and_load(per_file, planner, stage)
        else:
            self._fetch_and_load(per_file, planner, None)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fetch_and_load(
        self, per_file: dict[str, list[Any]], planner: LoadPlanner, stage: str | None
    ) -> None:
        def local_path(name: str) -> str:
            return self._target.path(name) if stage is None else os.path.join(stage, name)

        def fetch(name: str) -> None:
            if stage is not None:
                self._target.download(name, local_path(name))

        def verify(name: str, info: Any) -> None:
            with open(local_path(name), "rb") as fh:
                verify_items(fh, [info], self.path)

        def offset(item: Any) -> int:
            return self.storage_data[item.storage_index].offset

        total = sum(
            self.storage_data[i.storage_index].length for items in per_file.values() for i in items
        )
        bar = _staging.progress(total, "checkpoint download", self.is_coordinator)
        # Fetching and verifying run on worker threads, item by item in load order, so
        # the check of the next item overlaps the load of this one; every item is
        # verified before it is loaded. Loading (planner calls) stays on this thread.
        with ThreadPoolExecutor(self.thread_count, thread_name_prefix="nbtools-ckpt-io") as pool:
            fetched = {name: pool.submit(fetch, name) for name in per_file}
            checks: dict[tuple[str, int], Any] = {}
            try:
                for job in fetched.values():
                    job.result()
                for name, items in per_file.items():
                    for item in sorted(items, key=offset):
                        info = self.storage_data[item.storage_index]
                        key = (name, info.offset)
                        if self.verify and key not in checks:
                            checks[key] = pool.submit(verify, name, info)
                for name, items in per_file.items():
                    with open(local_path(name), "rb") as fh:
                        for item in sorted(items, key=offset):
                            check = checks.get((name, offset(item)))
                            if check is not None:
                                check.result()
                            self._load_item(fh, item, planner)
                            bar.update(self.storage_data[item.storage_index].length)
            except BaseException:
                for job in [*fetched.values(), *checks.values()]:
                    job.cancel()
                raise
            finally:
                bar.close()

    def _load_item(self, fh: Any, item: Any, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:
            fh.seek(info.offset)
            data = fh.read(info.length)
            check_weights_only(data, f"{self.path}: {item.storage_index.fqn}")
            planner.load_bytes(item, io.BytesIO(data))
            return
        from torch.distributed._shard._utils import narrow_tensor_by_index

        try:
            tensor = torch.load(
                _Slice(fh, info.offset, info.length), map_location="cpu", weights_only=True
            )
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(
                f"{self.path}: tensor {item.storage_index.fqn} cannot be read ({exc})"
            ) from exc
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
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
        return True
