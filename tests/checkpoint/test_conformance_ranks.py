"""DCP conformance on real gloo ranks: resharding, rank-local mode, interop, extensions.

Two launches serve every test here (the machine is small): one of 2 ranks and one
of 4. Each runs a function defined inside the fixture (as in a notebook cell)
that performs many saves and loads through ``dcp.save``/``dcp.load`` and returns
plain facts; the tests assert on them. The test process itself saves a
checkpoint the 4 ranks load (1 -> 4) and loads one they saved (4 -> 1).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbtools import distributed
from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.launch import _env

pytestmark = pytest.mark.slow


def _make_full():
    # Made inside a function, so that it travels to the ranks by value, like cell code.
    def full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole value of a test tensor: distinct, deterministic numbers per name."""
        numel = 1
        for dim in shape:
            numel *= dim
        return torch.arange(numel, dtype=torch.float32).reshape(shape) * 0.5 + len(name)

    return full


_full = _make_full()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    _env.warm_up()  # the interpreter-owned forkserver, before any per-test leak check
    return tmp_path_factory.mktemp("conformance")


@pytest.fixture(scope="module")
def two_ranks(work):
    """Facts from a 2-rank run; it also leaves 2-rank checkpoints under ``work``."""

    @distributed(processes=2)
    def job(work: str, full) -> dict:
        import io

        import torch.distributed as dist
        from torch.distributed.checkpoint._extension import ZStandard
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        rank = dist.get_rank()
        stage = os.path.join(work, "staging", f"two-{rank}")
        os.makedirs(stage, exist_ok=True)
        facts: dict = {}

        def attempt(name: str, step) -> None:
            """Record what ``step`` returns, or the error it raised (DCP's unwrapped)."""
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                result = step()
                facts[name] = "saved" if isinstance(result, dcp.Metadata) else result
            except (Exception, CheckpointException) as exc:  # noqa: BLE001
                inner = next(iter(getattr(exc, "failures", {}).values()), (exc,))[0]
                facts[name] = f"{type(inner).__name__}: {inner}"

        def path(name: str) -> str:
            return os.path.join(work, name)

        def writer(name: str, **kw) -> VolumeWriter:
            return VolumeWriter(path(name), staging_dir=stage, **kw)

        def reader(name: str, **kw) -> VolumeReader:
            return VolumeReader(path(name), staging_dir=stage, **kw)

        # -- rank-local mode (use_collectives=False) -----------------------------
        def mine() -> dict:
            return {
                f"rank{rank}": torch.full((3,), float(rank + 1)),
                f"note{rank}": {"from": rank, "ids": [rank] * 3},
                f"raw{rank}": io.BytesIO(b"\x00raw" + bytes([rank])),
            }

        def blank() -> dict:
            return {
                f"rank{rank}": torch.zeros(3),
                f"note{rank}": {"from": -1, "ids": [-1] * 3},  # DCP loads the keys given
                f"raw{rank}": io.BytesIO(),
            }

        def same_as_mine(got: dict) -> bool:
            want = mine()
            return (
                torch.equal(got[f"rank{rank}"], want[f"rank{rank}"])
                and got[f"note{rank}"] == want[f"note{rank}"]
                and got[f"raw{rank}"].getvalue() == want[f"raw{rank}"].getvalue()
            )

        def load_local(backend) -> bool:
            got = blank()
            dcp.load(got, storage_reader=backend)
            return same_as_mine(got)

        attempt(
            "local_save",
            lambda: dcp.save(mine(), storage_writer=writer("local_vol"), use_collectives=False),
        )
        dist.barrier()
        facts["local_files"] = sorted(os.listdir(path("local_vol")))
        attempt("local_vol_by_vol", lambda: load_local(reader("local_vol")))
        attempt("local_vol_by_fs", lambda: load_local(dcp.FileSystemReader(path("local_vol"))))
        dcp.save(
            mine(), storage_writer=dcp.FileSystemWriter(path("local_fs")), use_collectives=False
        )
        dist.barrier()
        attempt("local_fs_by_vol", lambda: load_local(reader("local_fs")))
        # A second rank-local save into the same directory is refused on every rank alike.
        attempt(
            "local_again",
            lambda: dcp.save(mine(), storage_writer=writer("local_vol"), use_collectives=False),
        )
        dist.barrier()

        # -- collective saves of DTensors, bytes and Python items ----------------
        mesh = init_device_mesh("cpu", (2,))

        def state(w_place, b_place) -> dict:
            return {
                "model": {
                    "w": distribute_tensor(full("w", (8, 6)), mesh, [w_place]),
                    "b": distribute_tensor(full("b", (6,)), mesh, [b_place]),
                },
                "plain": full("plain", (5,)),
                "step": 7,
                "meta": {"name": "run", "ids": [1, 2, 3]},
                "blob": io.BytesIO(b"\x00\x01 raw bytes"),
            }

        def empty(w_place, b_place) -> dict:
            return {
                "model": {
                    "w": distribute_tensor(torch.zeros(8, 6), mesh, [w_place]),
                    "b": distribute_tensor(torch.zeros(6), mesh, [b_place]),
                },
                "plain": torch.zeros(5),
                "step": 0,
                "meta": {"name": "", "ids": [0, 0, 0]},
                "blob": io.BytesIO(),
            }

        def matches(got: dict) -> bool:
            return (
                torch.equal(got["model"]["w"].full_tensor(), full("w", (8, 6)))
                and torch.equal(got["model"]["b"].full_tensor(), full("b", (6,)))
                and torch.equal(got["plain"], full("plain", (5,)))
                and got["step"] == 7
                and got["meta"] == {"name": "run", "ids": [1, 2, 3]}
                and got["blob"].getvalue() == b"\x00\x01 raw bytes"
            )

        def load(got: dict, **kw) -> bool:
            dcp.load(got, **kw)
            return matches(got)

        # checkpoint_id= given to dcp.save/dcp.load moves the backend to that path.
        attempt(
            "w2_save",
            lambda: dcp.save(
                state(Shard(0), Replicate()),
                checkpoint_id=path("w2_vol"),
                storage_writer=writer("unused"),
            ),
        )
        attempt(
            "w2_reshard_by_vol",
            lambda: load(
                empty(Replicate(), Shard(0)),
                checkpoint_id=path("w2_vol"),
                storage_reader=reader("unused"),
            ),
        )
        attempt(
            "w2_vol_by_fs",
            lambda: load(
                empty(Shard(1), Shard(0)), storage_reader=dcp.FileSystemReader(path("w2_vol"))
            ),
        )
        dcp.save(state(Shard(1), Shard(0)), storage_writer=dcp.FileSystemWriter(path("w2_fs")))
        attempt(
            "w2_fs_by_vol",
            lambda: load(empty(Shard(0), Replicate()), storage_reader=reader("w2_fs")),
        )
        if ZStandard.is_available():
            dcp.save(
                state(Shard(0), Replicate()),
                storage_writer=dcp.FileSystemWriter(path("w2_zstd"), _extensions=[ZStandard()]),
            )
            attempt(
                "w2_zstd_by_vol",
                lambda: load(empty(Shard(1), Shard(0)), storage_reader=reader("w2_zstd")),
            )

        # -- empty state dicts ---------------------------------------------------
        def empty_round_trip() -> tuple:
            dcp.save({}, storage_writer=writer("w2_empty"))
            got: dict = {}
            dcp.load(got, storage_reader=reader("w2_empty"))
            return got, os.path.exists(path("w2_empty/.metadata"))

        attempt("empty", empty_round_trip)
        facts["staging_left"] = os.listdir(stage)
        return facts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return job.distributed(str(work), _full)


@pytest.fixture(scope="module")
def four_ranks(work, two_ranks):
    """Facts from a 4-rank run that loads the 2-rank and 1-process checkpoints and saves its own."""
    w1 = {"model": {"w": _full("w", (8, 6)), "b": _full("b", (6,))}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves in a single process
        dcp.save(w1, storage_writer=VolumeWriter(work / "w1_vol"))

    @distributed(processes=4)
    def job(work: str, full) -> dict:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        rank = dist.get_rank()
        stage = os.path.join(work, "staging", f"four-{rank}")
        os.makedirs(stage, exist_ok=True)
        facts: dict = {}

        def attempt(name: str, step) -> None:
            """Record what ``step`` returns, or the error it raised (DCP's unwrapped)."""
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                result = step()
                facts[name] = "saved" if isinstance(result, dcp.Metadata) else result
            except (Exception, CheckpointException) as exc:  # noqa: BLE001
                inner = next(iter(getattr(exc, "failures", {}).values()), (exc,))[0]
                facts[name] = f"{type(inner).__name__}: {inner}"

        def path(name: str) -> str:
            return os.path.join(work, name)

        def model(mesh, w_place, b_place, value=None) -> dict:
            make = value or (lambda name, shape: torch.zeros(shape))
            return {
                "w": distribute_tensor(make("w", (8, 6)), mesh, w_place),
                "b": distribute_tensor(make("b", (6,)), mesh, b_place),
            }

        def matches(got: dict) -> bool:
            return torch.equal(got["w"].full_tensor(), full("w", (8, 6))) and torch.equal(
                got["b"].full_tensor(), full("b", (6,))
            )

        mesh1 = init_device_mesh("cpu", (4,))
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))

        def load(mesh, w_place, b_place, reader, **kw) -> bool:
            got = {"model": model(mesh, w_place, b_place)}
            dcp.load(got, storage_reader=reader, **kw)
            return matches(got["model"])

        def vol(name: str) -> VolumeReader:
            return VolumeReader(path(name), staging_dir=stage)

        # 2 -> 4 ranks, into a 1-D and a 2-D mesh; 1 -> 4 ranks.
        attempt("w2_to_w4_1d", lambda: load(mesh1, [Shard(0)], [Shard(0)], vol("w2_vol")))
        attempt(
            "w2_fs_to_w4_2d",
            lambda: load(mesh2, [Shard(0), Shard(1)], [Replicate(), Shard(0)], vol("w2_fs")),
        )
        attempt("w1_to_w4", lambda: load(mesh1, [Shard(1)], [Replicate()], vol("w1_vol")))

        # 4 ranks save on a 2-D mesh; reloaded with other placements, by FileSystemReader,
        # and by two 2-rank groups at once (4 -> 2).
        saved = {"model": model(mesh2, [Shard(1), Shard(0)], [Shard(0), Replicate()], full)}
        attempt(
            "w4_save",
            lambda: dcp.save(
                saved,
                checkpoint_id=path("w4_vol"),
                storage_writer=VolumeWriter(path("unused"), staging_dir=stage),
            ),
        )
        attempt(
            "w4_by_fs",
            lambda: load(mesh1, [Replicate()], [Shard(0)], dcp.FileSystemReader(path("w4_vol"))),
        )
        sub = mesh2["b"]
        attempt(
            "w4_to_w2",
            lambda: load(sub, [Shard(0)], [Shard(0)], vol("w4_vol"), process_group=sub.get_group()),
        )
        dist.barrier()
        facts["staging_left"] = os.listdir(stage)
        return facts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return job.distributed(str(work), _full)


@pytest.mark.parametrize("run, fact", [(2, "local_save"), (2, "w2_save"), (4, "w4_save")])
def test_saves_on_ranks_succeed(two_ranks, four_ranks, run, fact):
    facts = two_ranks if run == 2 else four_ranks
    assert [f[fact] for f in facts] == ["saved"] * run


def test_rank_local_save_writes_per_rank_files_and_metadata(two_ranks):
    # As FileSystemWriter does with use_collectives=False: per-rank prefixes, per-rank
    # metadata, no global .metadata.
    assert two_ranks[0]["local_files"] == [
        "__0.metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "__1.metadata",
        "__1_0.distcp",
        "__1_1.distcp",
    ]


@pytest.mark.parametrize("fact", ["local_vol_by_vol", "local_vol_by_fs", "local_fs_by_vol"])
def test_rank_local_checkpoints_load_on_each_rank(two_ranks, fact):
    assert [facts[fact] for facts in two_ranks] == [True, True]


def test_rank_local_save_into_a_complete_one_is_refused_on_every_rank(two_ranks):
    for facts in two_ranks:
        assert facts["local_again"].startswith("CheckpointError: Checkpoint already exists")


@pytest.mark.parametrize(
    "fact", ["w2_reshard_by_vol", "w2_vol_by_fs", "w2_fs_by_vol", "w2_zstd_by_vol"]
)
def test_two_rank_dtensor_checkpoints_reshard_and_interoperate(two_ranks, fact):
    if fact == "w2_zstd_by_vol" and fact not in two_ranks[0]:
        pytest.skip("neither zstandard nor pyzstd is installed")
    assert [facts[fact] for facts in two_ranks] == [True, True]


def test_empty_state_dict_round_trip_on_two_ranks(two_ranks):
    assert [facts["empty"] for facts in two_ranks] == [({}, True), ({}, True)]


@pytest.mark.parametrize(
    "fact", ["w2_to_w4_1d", "w2_fs_to_w4_2d", "w1_to_w4", "w4_by_fs", "w4_to_w2"]
)
def test_four_rank_resharding(four_ranks, fact):
    assert [facts[fact] for facts in four_ranks] == [True] * 4


def test_four_rank_checkpoint_loads_in_a_plain_process(four_ranks, work):
    got = {"model": {"w": torch.zeros(8, 6), "b": torch.zeros(6)}}
    dcp.load(got, storage_reader=VolumeReader(work / "w4_vol"), no_dist=True)
    assert torch.equal(got["model"]["w"], _full("w", (8, 6)))
    assert torch.equal(got["model"]["b"], _full("b", (6,)))


def test_ranks_leave_no_staged_files(two_ranks, four_ranks):
    assert all(facts["staging_left"] == [] for facts in [*two_ranks, *four_ranks])
