"""Restores in one process: only the byte ranges needed, stalls, damage, planners, fallbacks.

The checkpoints live on an S3-compatible server in its own process that counts
the object bytes it serves (``benchmarks/_capped_s3.py``), reached through
``s3://`` URLs as a user reaches S3.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _restore_servers import s3_env, s3_served, s3_server, s3_stall
from torch.distributed.checkpoint.api import CheckpointException

from nbtools.checkpoint import CheckpointManager, VolumeReader, VolumeWriter
from nbtools.checkpoint._storage._coop_read import plan_reads
from nbtools.checkpoint._storage._ranges import crc32_of, fetch_range, split
from nbtools.checkpoint._storage._target import LocalTarget
from nbtools.errors import CheckpointStallError, CorruptCheckpointError, StagingSpaceError

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "nbtools-reads"
MiB = 1 << 20


@pytest.fixture(scope="module")
def server():
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(server, monkeypatch):
    for name, value in s3_env(server).items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        fs.rm(BUCKET, recursive=True)
        s3fs.S3FileSystem.close_session(fs.loop, fs.s3)
        s3fs.S3FileSystem.clear_instance_cache()


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs in a single process
        return fn()


def _logged(fn) -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("nbtools.checkpoint")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return [r.getMessage() for r in records]


def _inner(info) -> BaseException:
    """The error of rank 0 inside DCP's ``CheckpointException``."""
    inner = next(iter(getattr(info.value, "failures", {}).values()), info.value)
    return inner[0] if isinstance(inner, tuple) else inner


def test_plan_reads_assigns_each_shared_record_once_spread_by_bytes():
    a, b, c = ("f0", 0, 300), ("f0", 300, 500), ("f1", 0, 100)
    mine = ("f2", 0, 50)
    fetch, messages, shared = plan_reads([[a, b, c], [a, b, c, mine], [a, b]], chunk_size=128)
    assert shared == 900
    fetched = [k for keys in fetch for k in keys]
    assert sorted(fetched) == sorted([a, b, c, mine])  # each record on exactly one rank
    assert mine in fetch[1]  # a record one rank needs is read by that rank
    assert all(fetch)  # the work is spread over the ranks
    for reader, segments in messages:
        assert sum(n for _, _, n in segments) <= 128
        assert all(key in fetch[reader] for key, _, _ in segments)
    covered: dict = {}
    for _, segments in messages:
        for key, start, n in segments:
            assert start == covered.get(key, 0)  # in order, no gaps, no overlap
            covered[key] = start + n
    assert covered == {a: 300, b: 500, c: 100}


def test_split_pieces_cover_the_range_within_the_knobs():
    assert split(10 * MiB, 64 * MiB, 8 * MiB) == [(0, 10 * MiB)]
    pieces = split(100 * MiB + 3, 16 * MiB, 4 * MiB)
    assert sum(n for _, n in pieces) == 100 * MiB + 3
    assert all(start == sum(n for _, n in pieces[:i]) for i, (start, _) in enumerate(pieces))
    assert all(4 * MiB <= n <= 16 * MiB + 1 for _, n in pieces)


def test_records_are_checked_from_the_crcs_of_the_blocks_as_fetched(tmp_path):
    # Three records in one file, fetched as two pieces that do not end where records do.
    data = os.urandom(3 * MiB + 7)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(data)
    target = LocalTarget(tmp_path / "src")
    records = [(0, MiB // 2), (MiB // 2, 2 * MiB), (5 * MiB // 2, MiB // 2 + 7)]
    cuts = [offset for offset, _ in records[1:]]
    dest = str(tmp_path / "staged")
    blocks = fetch_range(target, "f", 0, 2 * MiB, dest, 10.0, lambda n: None, cuts)
    blocks += fetch_range(target, "f", 2 * MiB, MiB + 7, dest, 10.0, lambda n: None, cuts)
    for offset, length in records:
        assert crc32_of(blocks, offset, length) == zlib.crc32(data[offset : offset + length])
    assert crc32_of(blocks, 0, 3 * MiB + 7) == zlib.crc32(data)
    assert crc32_of(blocks, 100, 1000) is None  # not covered exactly: read again instead
    assert (tmp_path / "staged").read_bytes() == data


def _two_big(fs, name: str) -> int:
    """A checkpoint of two 8 MiB tensors in one file; returns the object's size."""
    state = {"a": torch.arange(2 * MiB, dtype=torch.float32), "b": torch.ones(2 * MiB)}
    _quiet(
        lambda: dcp.save(
            state, storage_writer=VolumeWriter(f"s3://{BUCKET}/{name}", thread_count=1)
        )
    )
    fs.invalidate_cache()
    files = [p for p in fs.ls(f"{BUCKET}/{name}") if p.endswith(".distcp")]
    assert len(files) == 1
    return fs.size(files[0])


def test_a_load_fetches_only_the_ranges_it_needs(s3, server, staging_dir):
    size = _two_big(s3, "part")
    got = {"b": torch.zeros(2 * MiB)}
    s3_served(server, reset=True)
    _quiet(lambda: dcp.load(got, storage_reader=VolumeReader(f"s3://{BUCKET}/part")))
    assert torch.equal(got["b"], torch.ones(2 * MiB))
    # One of the two tensors and the metadata: about half the file, not all of it.
    assert s3_served(server) < 0.6 * size
    assert os.listdir(staging_dir) == []


def test_large_items_arrive_as_parallel_ranged_pieces(s3, server):
    _two_big(s3, "pieces")
    got = {"a": torch.zeros(2 * MiB), "b": torch.zeros(2 * MiB)}
    reader = VolumeReader(f"s3://{BUCKET}/pieces", chunk_size=MiB, min_chunk_size=MiB // 4)
    _quiet(lambda: dcp.load(got, storage_reader=reader))
    assert torch.equal(got["a"], torch.arange(2 * MiB, dtype=torch.float32))
    assert torch.equal(got["b"], torch.ones(2 * MiB))


@pytest.mark.slow
def test_staging_space_is_checked_against_what_is_fetched(s3, tiny_tmpfs):
    # 40 MiB checkpoint file, 50 MB staging: the 4 MiB item needed fits, the file would not.
    state = {f"t{i}": torch.full((MiB,), float(i)) for i in range(10)}
    _quiet(
        lambda: dcp.save(state, storage_writer=VolumeWriter(f"s3://{BUCKET}/space", thread_count=1))
    )
    got = {"t3": torch.zeros(MiB)}
    reader = VolumeReader(f"s3://{BUCKET}/space", staging_dir=tiny_tmpfs)
    _quiet(lambda: dcp.load(got, storage_reader=reader))
    assert torch.equal(got["t3"], torch.full((MiB,), 3.0))
    huge = {"huge": torch.zeros(16 * MiB)}
    _quiet(lambda: dcp.save(huge, storage_writer=VolumeWriter(f"s3://{BUCKET}/huge")))
    with pytest.raises((Exception, CheckpointException)) as info:
        _quiet(
            lambda: dcp.load(
                {"huge": torch.zeros(16 * MiB)},
                storage_reader=VolumeReader(f"s3://{BUCKET}/huge", staging_dir=tiny_tmpfs),
            )
        )
    assert isinstance(_inner(info), StagingSpaceError)
    assert "64.0 MiB of local staging" in str(_inner(info))


def test_a_stalled_object_store_fails_the_load_with_a_clear_error(s3, server, staging_dir):
    _two_big(s3, "stall")
    got = {"a": torch.zeros(2 * MiB), "b": torch.zeros(2 * MiB)}
    s3_stall(server, ".distcp")
    began = time.monotonic()
    try:
        with pytest.raises((Exception, CheckpointException)) as info:
            _quiet(
                lambda: dcp.load(
                    got, storage_reader=VolumeReader(f"s3://{BUCKET}/stall", read_timeout=2)
                )
            )
    finally:
        s3_stall(server, None)
    inner = _inner(info)
    assert isinstance(inner, CheckpointStallError)
    text = str(inner)
    assert "__0_0.distcp bytes " in text and "made no progress for 2 s" in text
    assert "rank 0" in text and "host " in text and "read_timeout=" in text
    assert time.monotonic() - began < 2 + 60  # not forever
    assert torch.equal(got["a"], torch.zeros(2 * MiB))  # nothing half-loaded
    assert os.listdir(staging_dir) == []


def test_damage_on_the_store_names_the_file_and_the_reading_rank(s3):
    _two_big(s3, "damaged")
    path = next(p for p in s3.ls(f"{BUCKET}/damaged") if p.endswith(".distcp"))
    data = bytearray(s3.cat_file(path))
    data[len(data) // 3] ^= 0xFF
    s3.pipe_file(path, bytes(data))
    got = {"a": torch.zeros(2 * MiB), "b": torch.zeros(2 * MiB)}
    with pytest.raises((Exception, CheckpointException)) as info:
        _quiet(lambda: dcp.load(got, storage_reader=VolumeReader(f"s3://{BUCKET}/damaged")))
    inner = _inner(info)
    assert isinstance(inner, CorruptCheckpointError)
    assert "__0_0.distcp" in str(inner) and "read by rank 0" in str(inner)


def test_one_rank_group_falls_back_and_says_why(s3, tmp_path):
    _two_big(s3, "one")
    got = {"a": torch.zeros(2 * MiB)}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        logged = _logged(lambda: dcp.load(got, storage_reader=VolumeReader(f"s3://{BUCKET}/one")))
    finally:
        dist.destroy_process_group()
    assert torch.equal(got["a"], torch.arange(2 * MiB, dtype=torch.float32))
    assert [m for m in logged if "one rank" in m]


def test_manager_restore_takes_a_planner(s3):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Recording(DefaultLoadPlanner):
        seen: list = []

        def commit_tensor(self, read_item, tensor):
            self.seen.append(read_item.dest_index.fqn)
            super().commit_tensor(read_item, tensor)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    root = f"s3://{BUCKET}/managed"
    with CheckpointManager(root, save_on_close=False) as ckpt:
        ckpt.save(3, model=model)
    other = torch.nn.Linear(8, 4)
    with CheckpointManager(root, save_on_close=False) as ckpt:
        assert ckpt.restore(model=other, planner=Recording()) == 4
    assert torch.equal(other.weight, model.weight)
    assert any("weight" in name for name in Recording.seen)
