"""Restores on real gloo ranks: each stored byte served once per job, resharding, stalls.

One launch of 2 ranks and one of 4 serve every test here. Each runs a function
defined inside its fixture (as in a notebook cell) that restores checkpoints
from an S3-compatible server and from a FUSE mount, both in processes of
their own that count the bytes they serve, and returns plain facts; the tests
assert on them. The test process saves the data-parallel checkpoint (as
DDP's rank 0 would) and restores the FSDP2 one the 2 ranks saved (2 -> 1).
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _restore_servers import fuse_mount, fuse_reason, s3_env, s3_server

from nbtools import distributed
from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.launch import _env

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow

BUCKET = "nbtools-restore"


def _make_net():
    # Made inside a function, so that it travels to the ranks by value, like cell code.
    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
        )

    return net


_net = _make_net()


def _trained(seed: int):
    """A model and its Adam state after two steps (as every DDP rank holds them)."""
    model = _net(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _size(fs, prefix: str) -> int:
    fs.invalidate_cache()
    return sum(fs.du(prefix, total=False).values())


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    """The S3 server and a FUSE mount, both holding the data-parallel checkpoint."""
    _env.warm_up()
    import s3fs

    work = tmp_path_factory.mktemp("restore")
    with s3_server() as endpoint, pytest.MonkeyPatch.context() as mp:
        for name, value in s3_env(endpoint).items():
            mp.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt = _trained(0)
        msd, osd = get_state_dict(model, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it saves in a single process
            dcp.save({"model": msd, "optim": osd}, storage_writer=VolumeWriter(f"s3://{BUCKET}/dp"))
            dcp.save({"model": msd, "optim": osd}, storage_writer=VolumeWriter(work / "dp_src"))
        facts = {
            "endpoint": endpoint,
            "work": str(work),
            "dp_size": _size(fs, f"{BUCKET}/dp"),
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": osd,
            "fs": fs,
        }
        reason = fuse_reason()
        mount = None
        try:
            if reason is None:
                ctx = fuse_mount(str(work / "dp_src"), str(work / "mnt"), str(work / "ctl"))
                mount = ctx.__enter__()
            facts["mount"] = mount
            facts["fuse_skip"] = reason
            facts["dp_local_size"] = sum(
                os.path.getsize(work / "dp_src" / n) for n in os.listdir(work / "dp_src")
            )
            yield facts
        finally:
            if mount is not None:
                ctx.__exit__(None, None, None)
            s3fs.S3FileSystem.close_session(fs.loop, fs.s3)
            s3fs.S3FileSystem.clear_instance_cache()


def _rank_code():
    """Helpers the ranks use, defined in a function so they travel by value."""

    def restore_dp(net, url, **kw):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net(1 + dist.get_rank()))  # other values than saved, on every rank
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(2, 512)).sum().backward()
        opt.step()  # Adam state exists, with other values
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        planner = kw.pop("planner", None)
        dcp.load(state, storage_reader=VolumeReader(url, **kw), planner=planner)
        return {k: v.clone() for k, v in state["model"].items()}, state["optim"]

    def served_during(endpoint, fn):
        """(result of fn, object bytes the S3 server sent meanwhile), on every rank."""
        import torch.distributed as dist
        from _restore_servers import s3_served

        dist.barrier()
        before = s3_served(endpoint)
        dist.barrier()
        result = fn()
        dist.barrier()
        return result, s3_served(endpoint) - before

    def captured(fn):
        """(result, messages nbtools.checkpoint logged at INFO and above)."""
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("nbtools.checkpoint")
        logger.addHandler(handler)
        old = logger.level
        logger.setLevel(logging.INFO)
        try:
            return fn(), [r.getMessage() for r in records]
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old)

    def failure(fn):
        """The text of the error ``fn`` raised on this rank (DCP's unwrapped), its seconds."""
        import time

        from torch.distributed.checkpoint.api import CheckpointException

        began = time.monotonic()
        try:
            fn()
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            inner = next(iter(getattr(exc, "failures", {}).values()), exc)
            inner = inner[0] if isinstance(inner, tuple) else inner  # (error, traceback)
            return f"{type(inner).__name__}: {inner}", time.monotonic() - began
        return "no error", time.monotonic() - began

    return restore_dp, served_during, captured, failure


@pytest.fixture(scope="module")
def two_ranks(volumes):
    """Facts from 2 ranks: data-parallel restores from S3 and FUSE, an FSDP2 save, a stall."""

    @distributed(processes=2)
    def job(v: dict, net, code) -> dict:
        import faulthandler
        import sys
        import threading

        import torch.distributed as dist
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sys.path.insert(0, v["tests"])
        faulthandler.dump_traceback_later(240, exit=True)  # a hang fails, it never blocks
        restore_dp, served_during, captured, failure = code
        rank = dist.get_rank()
        stage = os.path.join(v["work"], "staging2", str(rank))
        os.makedirs(stage, exist_ok=True)
        endpoint, dp = v["endpoint"], f"s3://{BUCKET}/dp"
        facts: dict = {}

        facts["dp"], facts["dp_served"] = served_during(
            endpoint, lambda: restore_dp(net, dp, staging_dir=stage)
        )
        (_, facts["per_rank_served"]), facts["per_rank_log"] = captured(
            lambda: served_during(
                endpoint, lambda: restore_dp(net, dp, staging_dir=stage, read_once=False)
            )
        )
        facts["dp_default_planner"], facts["default_planner_served"] = served_during(
            endpoint, lambda: restore_dp(net, dp, staging_dir=stage, planner=DefaultLoadPlanner())
        )

        class Counting(DefaultLoadPlanner):
            """A user's planner: records each tensor it commits, scales nothing."""

            committed: list = []

            def commit_tensor(self, read_item, tensor):
                self.committed.append(read_item.dest_index.fqn)
                super().commit_tensor(read_item, tensor)

        facts["dp_custom_planner"], facts["custom_served"] = served_during(
            endpoint,
            lambda: restore_dp(
                net,
                dp,
                staging_dir=stage,
                planner=Counting(),
                chunk_size=1 << 20,
                min_chunk_size=1 << 18,
            ),
        )
        facts["custom_committed"] = sorted(set(Counting.committed))

        # FUSE mount: bytes counted at the daemon, served with direct I/O.
        if v["mount"] is not None:
            from _restore_servers import fuse_served

            ctl = os.path.join(v["work"], "ctl")
            dist.barrier()
            before = fuse_served(ctl)
            dist.barrier()
            facts["fuse"] = restore_dp(net, v["mount"], staging_dir=stage)
            dist.barrier()
            facts["fuse_served"] = fuse_served(ctl) - before
            # A FUSE read that never answers: every rank fails within read_timeout.
            if rank == 0:
                with open(os.path.join(ctl, "stall"), "w") as fh:
                    fh.write(".distcp")
            dist.barrier()
            facts["fuse_stall"] = failure(
                lambda: restore_dp(net, v["mount"], staging_dir=stage, read_timeout=3)
            )
            dist.barrier()
            if rank == 0:
                os.unlink(os.path.join(ctl, "stall"))
            dist.barrier()
            for t in threading.enumerate():
                if t.name.startswith("nbtools-ckpt"):
                    t.join(timeout=20)
            facts["fuse_stall_threads"] = [
                t.name for t in threading.enumerate() if t.name.startswith("nbtools-ckpt")
            ]
            facts["fuse_stall_staging"] = os.listdir(stage)

        # Rank-local checkpoint on S3: each rank reads its own, said once.
        mine = {f"r{rank}": torch.full((1000,), float(rank))}
        dcp.save(mine, storage_writer=VolumeWriter(f"s3://{BUCKET}/local"), use_collectives=False)
        dist.barrier()
        got = {f"r{rank}": torch.zeros(1000)}
        _, facts["local_log"] = captured(
            lambda: dcp.load(
                got, storage_reader=VolumeReader(f"s3://{BUCKET}/local", staging_dir=stage)
            )
        )
        facts["local_ok"] = torch.equal(got[f"r{rank}"], mine[f"r{rank}"])

        # FSDP2 on 2 ranks, saved for the 4-rank restore and the one in the test process.
        model = net(7)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=VolumeWriter(f"s3://{BUCKET}/fsdp"))
        facts["fsdp_full"] = {k: t.full_tensor().clone() for k, t in msd.items()}
        facts["fsdp_optim_full"] = {
            k: {
                n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
                for n, t in s.items()
            }
            for k, s in osd["state"].items()
        }
        facts["staging_left"] = os.listdir(stage)
        faulthandler.cancel_dump_traceback_later()
        return facts

    v = {
        **{k: volumes[k] for k in ("endpoint", "work", "mount")},
        "tests": os.path.dirname(__file__),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return job.distributed(v, _net, _rank_code())


@pytest.fixture(scope="module")
def four_ranks(volumes, two_ranks):
    """Facts from 4 ranks: data-parallel and FSDP2 (2 -> 4) restores, a subgroup, a stall."""

    @distributed(processes=4)
    def job(v: dict, net, code) -> dict:
        import faulthandler
        import sys
        import threading

        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sys.path.insert(0, v["tests"])
        from _restore_servers import s3_stall

        faulthandler.dump_traceback_later(240, exit=True)
        restore_dp, served_during, captured, failure = code
        rank = dist.get_rank()
        stage = os.path.join(v["work"], "staging4", str(rank))
        os.makedirs(stage, exist_ok=True)
        endpoint, dp = v["endpoint"], f"s3://{BUCKET}/dp"
        facts: dict = {}
        facts["dp"], facts["dp_served"] = served_during(
            endpoint, lambda: restore_dp(net, dp, staging_dir=stage)
        )
        facts["dp_small"], facts["dp_small_served"] = served_during(
            endpoint,
            lambda: restore_dp(
                net, dp, staging_dir=stage, chunk_size=1 << 20, min_chunk_size=1 << 18
            ),
        )

        def fsdp_restore():
            model = net(99)
            fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            model(torch.randn(4, 512)).square().mean().backward()
            opt.step()
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, storage_reader=VolumeReader(f"s3://{BUCKET}/fsdp", staging_dir=stage))
            full = {k: t.full_tensor().clone() for k, t in state["model"].items()}
            optim = {
                k: {
                    n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
                    for n, t in s.items()
                }
                for k, s in state["optim"]["state"].items()
            }
            return full, optim

        facts["fsdp"], facts["fsdp_served"] = served_during(endpoint, fsdp_restore)

        # Two subgroups of 2 load with the reader on the default group: the reader says why
        # it reads per rank, and the load still succeeds.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = pairs[rank // 2]

        def pair_load():
            t = {"w": torch.zeros(100)}
            dcp.load(
                t,
                storage_reader=VolumeReader(f"s3://{BUCKET}/pair", staging_dir=stage),
                process_group=mine,
            )
            return torch.equal(t["w"], torch.arange(100.0))

        dcp.save({"w": torch.arange(100.0)}, storage_writer=VolumeWriter(f"s3://{BUCKET}/pair"))
        facts["pair_ok"], facts["pair_log"] = captured(pair_load)

        # An object store that stops answering: every rank fails within read_timeout.
        dist.barrier()
        if rank == 0:
            s3_stall(endpoint, ".distcp")
        dist.barrier()
        facts["s3_stall"] = failure(lambda: restore_dp(net, dp, staging_dir=stage, read_timeout=3))
        dist.barrier()
        if rank == 0:
            s3_stall(endpoint, None)
        dist.barrier()
        for t in threading.enumerate():
            if t.name.startswith("nbtools-ckpt"):
                t.join(timeout=20)
        facts["threads_left"] = [
            t.name for t in threading.enumerate() if t.name.startswith("nbtools-ckpt")
        ]
        facts["staging_left"] = os.listdir(stage)
        for group in pairs:
            dist.destroy_process_group(group)
        faulthandler.cancel_dump_traceback_later()
        return facts

    v = {
        **{k: volumes[k] for k in ("endpoint", "work", "mount")},
        "tests": os.path.dirname(__file__),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return job.distributed(v, _net, _rank_code())


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want, strict=True))
    return got == want


def _equal_dp(restored, volumes) -> bool:
    model, optim = restored
    return _same(model, volumes["model"]) and _same(optim, volumes["optim"])


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_restore_reads_each_byte_once(world, volumes, two_ranks, four_ranks):
    facts = two_ranks if world == 2 else four_ranks
    assert all(_equal_dp(f["dp"], volumes) for f in facts)
    # Every rank needs every byte; the server sent the checkpoint about once, not N times.
    assert facts[0]["dp_served"] <= 1.05 * volumes["dp_size"]
    assert all(not f["staging_left"] for f in facts)


def test_small_chunks_split_large_items_and_still_read_once(volumes, four_ranks):
    assert all(_equal_dp(f["dp_small"], volumes) for f in four_ranks)
    assert four_ranks[0]["dp_small_served"] <= 1.05 * volumes["dp_size"]


def test_read_once_false_reads_per_rank_and_says_why(volumes, two_ranks):
    assert two_ranks[0]["per_rank_served"] >= 1.9 * volumes["dp_size"]
    assert [m for m in two_ranks[0]["per_rank_log"] if "read_once=False" in m]


def test_default_and_custom_planners(volumes, two_ranks):
    for f in two_ranks:
        assert _equal_dp(f["dp_default_planner"], volumes)
        assert _equal_dp(f["dp_custom_planner"], volumes)
        assert any(name.startswith("model.") for name in f["custom_committed"])
    assert two_ranks[0]["default_planner_served"] <= 1.05 * volumes["dp_size"]
    assert two_ranks[0]["custom_served"] <= 1.05 * volumes["dp_size"]


def test_fsdp2_saved_on_2_restores_on_4_bit_for_bit(volumes, two_ranks, four_ranks):
    saved = two_ranks[0]
    for f in four_ranks:
        full, optim = f["fsdp"]
        assert _same(full, saved["fsdp_full"])
        assert _same(optim, saved["fsdp_optim_full"])
    assert four_ranks[0]["fsdp_served"] <= 1.05 * _size(volumes["fs"], f"{BUCKET}/fsdp")


def test_fsdp2_saved_on_2_restores_in_one_process(volumes, two_ranks, caplog):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _net(5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    logger = logging.getLogger("nbtools.checkpoint")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="nbtools.checkpoint"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=VolumeReader(f"s3://{BUCKET}/fsdp"))
    finally:
        logger.removeHandler(caplog.handler)
    assert _same(state["model"], two_ranks[0]["fsdp_full"])
    optim = {k: dict(s) for k, s in state["optim"]["state"].items()}
    assert _same(optim, two_ranks[0]["fsdp_optim_full"])
    assert [r for r in caplog.records if "no process group" in r.getMessage()]


def test_rank_local_checkpoints_fall_back_and_say_so(two_ranks):
    assert all(f["local_ok"] for f in two_ranks)
    assert [m for m in two_ranks[0]["local_log"] if "rank-local" in m]


def test_a_reader_group_that_does_not_cover_the_load_falls_back(four_ranks):
    assert all(f["pair_ok"] for f in four_ranks)
    assert [m for m in four_ranks[0]["pair_log"] if "does not cover" in m]


def test_fuse_mount_served_once_per_job(volumes, two_ranks):
    if volumes["mount"] is None:
        pytest.skip(volumes["fuse_skip"])
    assert all(_equal_dp(f["fuse"], volumes) for f in two_ranks)
    assert two_ranks[0]["fuse_served"] <= 1.05 * volumes["dp_local_size"]


def _check_stall(text_seconds, read_timeout=3):
    text, seconds = text_seconds
    assert "CheckpointStallError" in text, text
    assert "made no progress for 3 s" in text and ".distcp bytes " in text
    assert "on rank " in text and "(host " in text and "load again" in text
    assert seconds < read_timeout + 60  # not the 30-minute collective timeout, nor forever


def test_stalled_object_store_fails_every_rank(four_ranks):
    for f in four_ranks:
        _check_stall(f["s3_stall"])
        assert f["threads_left"] == [] and f["staging_left"] == []


def test_stalled_fuse_read_fails_every_rank(volumes, two_ranks):
    if volumes["mount"] is None:
        pytest.skip(volumes["fuse_skip"])
    for f in two_ranks:
        _check_stall(f["fuse_stall"])
        assert f["fuse_stall_threads"] == [] and f["fuse_stall_staging"] == []
