"""Staging the byte ranges of a load: fetched once per job, verified where fetched.

:class:`StagedFetch` is the part of :class:`~nbtools.checkpoint.VolumeReader`
that runs when files are staged (object stores, network and FUSE mounts). It
notes each rank's group rank in its local plan, decides on the coordinator
who fetches which record (:func:`~nbtools.checkpoint._storage._coop_read.plan_reads`)
or why each rank reads for itself, and on every rank fetches its records into
the load's staging directory, hands shared ones over and verifies checksums,
before the reader loads anything from there.

The ranks of one node share the load's staging directory: a record handed
over is written there once per node (by the rank that fetched it when that one
is on the node, else by the first of the node's ranks that cannot take it
straight into its destination), and the others read that copy. The
coordinator checks the space every node stages against the free space its
ranks noted in their local plans, once per node, before any rank writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from nbtools import runtime
from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage import _coop_read, _scratch
from nbtools.checkpoint._storage._coop_read import NOTE, Key
from nbtools.checkpoint._storage._ranges import (
    FetchPool,
    crc32_of,
    fetch_range,
    split,
    stall_message,
)
from nbtools.checkpoint._storage._shards import item_checksum, verify_items
from nbtools.checkpoint._storage._target import Target
from nbtools.errors import CheckpointError, CheckpointStallError, CorruptCheckpointError

__all__ = ["StagedFetch"]

_log = get_logger("checkpoint")
_VERIFY_BLOCK = 4 << 20
#: Hand-off messages per chunk.
_PARTS = 4
#: A restore shorter than this shows no progress bar.
_BAR_DELAY_S = 3.0


def _bar(total: int, main: bool) -> Any:
    """Rank 0's progress bar (bytes, MB/s), shown once a restore has run a few seconds."""
    interactive = "ipykernel" in sys.modules or sys.stderr.isatty()
    if not (main and interactive and total):
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, desc="restore", unit="B", unit_scale=True, delay=_BAR_DELAY_S, leave=False
    )


class Timings:
    """Where one rank's load spent its time: phase -> seconds, logged at DEBUG."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.began = time.perf_counter()
        self._lock = threading.Lock()

    def mark(self, name: str, at: float | None = None) -> None:
        """Note when (seconds since the load began) ``name`` happened."""
        self.seconds[name] = (time.perf_counter() if at is None else at) - self.began

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - began)

    def text(self) -> str:
        return ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())


@dataclasses.dataclass
class StagedFetch:
    """Fetch settings of one reader (see :class:`~nbtools.checkpoint.VolumeReader`)."""

    target: Target
    where: str
    read_once: bool
    process_group: dist.ProcessGroup | None
    chunk_size: int
    min_chunk_size: int
    read_timeout: float
    thread_count: int
    verify: bool
    staging_base: str = ""
    storage_data: Any = None
    infos: dict[Key, Any] = dataclasses.field(default_factory=dict)
    use_collectives: bool = True
    timings: Timings = dataclasses.field(default_factory=Timings)

    def set_up(self, storage_data: Any, use_collectives: bool) -> None:
        """Take the checkpoint's storage data (``MetadataIndex`` -> ``_StorageInfo``)."""
        self.storage_data = storage_data
        self.use_collectives = use_collectives
        self.infos = {self.key(info): info for info in storage_data.values()}

    @property
    def message_size(self) -> int:
        """Bytes of one hand-off message: a quarter chunk (never under ``min_chunk_size``),
        so that the first messages are fetched and broadcast early."""
        return max(min(self.chunk_size, self.min_chunk_size), self.chunk_size // _PARTS)

    def key(self, info: Any) -> Key:
        return (info.relative_path, int(info.offset), int(info.length))

    # --- planning -----------------------------------------------------------------

    def local_note(self, plan: LoadPlan) -> LoadPlan:
        """The local plan with this rank's place in the hand-off group noted."""
        group = _coop_read.group_of(self.process_group)
        note = None if group is None else _coop_read.describe_group(group)
        if plan.storage_data is not None:
            return plan  # a planner's own storage data is left alone
        node, free = _scratch.node_of(self.staging_base)
        mine = {"group": note, "node": node, "free": free, "pid": os.getpid()}
        return dataclasses.replace(plan, storage_data={NOTE: mine})

    def _check_nodes(
        self, notes: list[Any], needs: list[list[Key]], shared: bool
    ) -> dict[tuple[Any, ...], list[int]] | None:
        """The ranks of each node (by the staging disk they noted), after one check per
        node that its disk holds what it stages (the records its ranks need, once each
        when ``shared``); None when a plan carries no note to check with."""
        if any(n is None or "node" not in n for n in notes):
            return None
        nodes: dict[tuple[Any, ...], list[int]] = {}
        for rank, note in enumerate(notes):
            nodes.setdefault(tuple(note["node"]), []).append(rank)
        for node, ranks in nodes.items():
            if shared:
                need = sum(k[2] for k in set().union(*(needs[r] for r in ranks)))
            else:
                need = sum(k[2] for r in ranks for k in set(needs[r]))
            free = min(int(notes[r]["free"]) for r in ranks)
            shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
            what = f"loading {self.where} on host {node[0]} (rank(s) {shown})"
            error = _scratch.space_shortage(str(node[1]), need, free, what)
            if error is not None:
                raise error
        return nodes

    def _why_not(self, plans: list[LoadPlan]) -> str | None:
        if not self.read_once:
            return "read_once=False"
        if not self.use_collectives:
            return "a rank-local checkpoint (saved with use_collectives=False)"
        notes = [
            p.storage_data.get(NOTE) if isinstance(p.storage_data, dict) else None for p in plans
        ]
        if len(plans) == 1:
            group = (notes[0] or {}).get("group")
            if group is None:
                return "no process group (no_dist=True, or torch.distributed not initialized)"
            return "one rank" if group[1] == 1 else "no_dist=True"
        known = [n for n in notes if n is not None]
        if len(known) < len(notes):
            return "the load planner replaced the reader's storage data in the plans"
        if any(n.get("group") != (rank, len(plans)) for rank, n in enumerate(known)):
            return (
                "VolumeReader's process_group= does not cover the ranks of this load in their "
                "order (pass the group given to dcp.load as VolumeReader(process_group=...))"
            )
        return None

    def global_notes(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: who fetches what, or why every rank reads for itself."""
        why = self._why_not(plans)
        notes: list[Any] = [
            p.storage_data.get(NOTE) if isinstance(p.storage_data, dict) else None for p in plans
        ]
        if why is not None:
            _log.info(
                "loading %s: every rank reads the ranges it needs itself: %s", self.where, why
            )
            # A rank-local checkpoint's items are in each rank's own metadata: each checks.
            known = all(i.storage_index in self.storage_data for p in plans for i in p.items)
            needs = [[self.key(self.infos_of(i)) for i in p.items] for p in plans] if known else []
            checked = known and self._check_nodes(notes, needs, shared=False) is not None
            return [
                dataclasses.replace(p, storage_data={NOTE: {"why": why, "checked": checked}})
                for p in plans
            ]
        needs = [[self.key(self.infos_of(i)) for i in p.items] for p in plans]
        nodes = self._check_nodes(notes, needs, shared=True)
        assert nodes is not None  # every plan has its note when the load reads once
        fetch, messages, shared = _coop_read.plan_reads(needs, self.message_size)
        token = uuid.uuid4().hex[:12]
        node_of: dict[int, tuple[str, list[int]]] = {}
        for ranks in nodes.values():
            area = _scratch.shared_name(int(notes[ranks[0]]["pid"]), token)
            node_of.update(dict.fromkeys(ranks, (area, ranks)))
        together = any(len(ranks) > 1 for ranks in nodes.values())
        return [
            dataclasses.replace(
                p,
                storage_data={
                    NOTE: {
                        "fetch": fetch[r],
                        "messages": messages,
                        "shared": shared,
                        "checked": True,
                        "area": node_of[r][0],
                        "peers": node_of[r][1],
                        "together": together,
                    }
                },
            )
            for r, p in enumerate(plans)
        ]

    def infos_of(self, item: Any) -> Any:
        return self.storage_data[item.storage_index]

    # --- fetching -------------------------------------------------------------------

    def run(
        self,
        plan: LoadPlan,
        note: dict[str, Any],
        planner: LoadPlanner,
        stage: str,
        delivery: _coop_read.Receiver,
    ) -> None:
        """Stage every record ``plan`` reads under ``stage``, fetched or handed over, verified;
        handed-over tensors whose destination takes their bytes as they are go to
        ``delivery`` instead."""
        needed = {self.key(self.infos_of(i)) for i in plan.items}
        coop = "messages" in note
        fetch: list[Key] = list(note["fetch"]) if coop else sorted(needed)
        messages = note.get("messages", []) if coop else []
        handed = {k for _, segs in messages for k, _, _ in segs}
        fetch += sorted(needed - set(fetch) - handed)  # items a planner added late
        if not note.get("checked"):
            staged_bytes = sum(k[2] for k in set(fetch) | needed)
            _scratch.check_space(os.path.dirname(stage), staged_bytes, f"loading {self.where}")
        rank = runtime.get_rank()
        own = sum(k[2] for k in fetch if k not in handed)
        bar = _bar(own + (note.get("shared", 0) if coop else 0), rank == 0)
        on_bytes = bar.update if bar is not None else (lambda n: None)
        pool = FetchPool(self.thread_count, self.read_timeout, rank, self.where, on_bytes)
        # Records handed over are fetched in hand-off order, about one message at a time
        # per rank: the first messages are broadcast early and, when the last bytes
        # arrive, little is left to hand over (all ranks together keep the volume busy).
        piece = max(self.min_chunk_size, self.message_size // self.thread_count)
        ahead = max(2, min(self.thread_count, self.message_size // piece))
        lead = FetchPool(ahead, self.read_timeout, rank, self.where, on_bytes) if handed else pool
        waits: dict[Key, FetchPool] = {}
        checked: dict[Key, Future[None]] = {}
        timings = self.timings

        def staged(name: str) -> str:
            return os.path.join(stage, name)

        def ready(key: Key) -> None:
            with timings.phase("fetch_wait"):
                waits[key].wait(checked[key])

        try:
            # Records that follow each other in a file are fetched as one range.
            spans: list[tuple[str, int, int, list[Key]]] = []
            for key in fetch:
                last = spans[-1] if spans else None
                if last is not None and last[0] == key[0] and last[1] + last[2] == key[1]:
                    spans[-1] = (last[0], last[1], last[2] + key[2], [*last[3], key])
                else:
                    spans.append((key[0], key[1], key[2], [key]))
            for name, offset, length, keys in spans:
                where = lead if keys[0] in handed else pool
                size = piece if where is lead else self.chunk_size
                cuts = [k[1] for k in keys[1:]]
                futures = [
                    self._submit(where, (name, offset, length), start, n, staged, cuts)
                    for start, n in split(length, size, self.min_chunk_size)
                ]
                waits.update(dict.fromkeys(keys, where))
                checks: dict[Key, Future[None]] = {key: Future() for key in keys}
                for future in checks.values():
                    future.nbtools_what = futures[0].nbtools_what  # type: ignore[attr-defined]
                checked.update(checks)
                self._verify_when_fetched(futures, checks, staged, rank)
            timings.mark("fetch_from")
            if coop:
                group = _coop_read.group_of(self.process_group)
                timings.mark("exchange_from")
                with timings.phase("exchange"):
                    _coop_read.exchange(
                        group,
                        dist.get_rank(group),
                        messages,
                        needed=needed,
                        ready=ready,
                        staged=staged,
                        cuda_destinations=lambda: _cuda_destinations(plan, planner),
                        on_bytes=on_bytes,
                        timings=timings,
                        delivery=_NodeReceiver(delivery, stage, note),
                        memory=2 * self.chunk_size,
                    )
                if note.get("together"):
                    # The node's copies of records handed over are whole before any rank
                    # of the node loads from them.
                    with timings.phase("exchange"):
                        dist.barrier(group=group)
            for key in fetch:
                ready(key)
            timings.mark("staged_at")
        finally:
            pool.close()
            lead.close()
            if bar is not None:
                bar.close()

    def _verify_when_fetched(
        self,
        futures: list[Future[Any]],
        checks: dict[Key, Future[None]],
        staged: Any,
        rank: int,
    ) -> None:
        """Verify the records of a span on the fetch thread that completes its last
        piece, and settle each record's future with the outcome."""
        left = [len(futures)]
        lock = threading.Lock()

        def piece_done(_: Future[Any]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                blocks = [b for future in futures for b in future.result()]  # or its error
                for key, check in checks.items():
                    with self.timings.phase("checksum"):
                        crc = crc32_of(blocks, key[1], key[2])
                        self._verify(key, staged(key[0]), rank, crc)
                    check.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - raised where the record is awaited
                for check in checks.values():
                    if not check.done():
                        check.set_exception(exc)

        for future in futures:
            future.add_done_callback(piece_done)

    def _submit(
        self, pool: FetchPool, key: Key, start: int, n: int, staged: Any, cuts: list[int]
    ) -> Future[Any]:
        name, offset, _ = key
        begin, end = offset + start, offset + start + n
        rank = runtime.get_rank()

        def job(progress: Any) -> list[tuple[int, int, int]]:
            try:
                blocks = fetch_range(
                    self.target, name, begin, n, staged(name), self.read_timeout, progress, cuts
                )
                self.timings.mark("fetched_at")
                return blocks
            except TimeoutError as exc:
                raise CheckpointStallError(
                    stall_message(rank, name, begin, end, self.where, self.read_timeout)
                ) from exc
            except EOFError as exc:
                raise CorruptCheckpointError(
                    f"{self.where}: {name} ends before byte {end} (file truncated), as read by "
                    f"rank {rank} (host {_coop_read.host()}); restore from another checkpoint"
                ) from exc
            except OSError as exc:
                raise CheckpointError(
                    f"reading {name} bytes {begin}..{end} of {self.where} on rank {rank} "
                    f"(host {_coop_read.host()}) failed: {exc}. Check the volume from that "
                    "host, then load again"
                ) from exc

        return pool.submit(job, (name, begin, end))

    def _verify(self, key: Key, path: str, rank: int, fetched: int | None = None) -> None:
        """Check a staged record against its recorded CRC-32 (when there is one): the CRC
        of the bytes as they were fetched, or (None) of the staged copy read again."""
        info = self.infos.get(key)
        expected = item_checksum(info) if (self.verify and info is not None) else None
        if expected is None or (fetched is not None and f"crc32:{fetched:08x}" == expected):
            return
        name, offset, length = key
        crc = 0
        with open(path, "rb", buffering=0) as fh:
            fh.seek(offset)
            left = length
            while left:
                data = fh.read(min(_VERIFY_BLOCK, left))
                if not data:
                    break
                crc = zlib.crc32(data, crc)
                left -= len(data)
        if f"crc32:{crc:08x}" == expected:
            return
        by = f"as read by rank {rank} (host {_coop_read.host()})"
        try:  # damage on the volume, or a file another save wrote again: read it there
            with self.target.open_read(name) as fh:
                verify_items(fh, [info], self.where)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{exc} ({by})") from None
        raise CorruptCheckpointError(
            f"{self.where}: bytes {offset}..{offset + length} of {name} {by} do not match their "
            "checksum, though they do on the volume (damaged in transfer); load again"
        )


class _NodeReceiver:
    """A rank's :class:`~nbtools.checkpoint._storage._coop_read.Receiver` that stages a
    record handed over only when no other rank of its node does."""

    def __init__(self, delivery: _coop_read.Receiver, area: str, note: dict[str, Any]) -> None:
        self._delivery, self._area = delivery, area
        self._shared = "area" in note
        self._peers = set(note.get("peers", ()))

    def frame(self, key: Key) -> tuple[int, int]:
        return self._delivery.frame(key)

    def sink(self, key: Key, offset: int, nbytes: int) -> Any:
        return self._delivery.sink(key, offset, nbytes)

    def done(self, key: Key) -> None:
        self._delivery.done(key)

    def stages(self, key: Key, reader: int) -> bool:
        if not self._shared:
            return True
        if reader in self._peers:
            return False  # its fetcher staged it in this node's area
        return _scratch.claim(self._area, key)


def _cuda_destinations(plan: LoadPlan, planner: LoadPlanner) -> bool:
    """Whether any tensor of this rank's plan loads into a CUDA tensor."""
    for item in plan.items:
        if item.type == LoadItemType.TENSOR:
            return planner.resolve_tensor(item).device.type == "cuda"
    return False
