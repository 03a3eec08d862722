"""DCP conformance in one process: VolumeWriter/VolumeReader behave as FileSystemWriter/Reader.

Covers what DCP and frameworks can ask of a storage backend without a process
group: ``checkpoint_id=``, backend selection by ``validate_checkpoint_id``, bytes
and plain Python items, empty state dicts, rank-local (``use_collectives=False``)
checkpoints, stream extensions, and the errors that tell misuse from damage.
The multi-rank cases are in ``test_conformance_ranks.py``.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard

from nbtools.checkpoint import VolumeReader, VolumeWriter
from nbtools.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError


@pytest.fixture(autouse=True)
def _quiet_single_process_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state() -> dict:
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "half": torch.arange(5).half(),
        "blob": io.BytesIO(b"\x00\x01raw"),
        "raw": b"\xffbytes value",
        "step": 12,
        "meta": {"name": "run", "ids": [1, 2, 3], "lr": 0.5},
    }


def _blank() -> dict:
    # DCP loads the keys the destination has, so it has the same structure.
    return {
        "w": torch.zeros(4, 6),
        "half": torch.zeros(5).half(),
        "blob": io.BytesIO(),
        "raw": b"",
        "step": 0,
        "meta": {"name": "", "ids": [0, 0, 0], "lr": 0.0},
    }


def _assert_loaded(got: dict) -> None:
    want = _state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["half"], want["half"])
    assert got["blob"].getvalue() == want["blob"].getvalue()
    assert (got["raw"], got["step"], got["meta"]) == (want["raw"], want["step"], want["meta"])


def _failure(exc: BaseException) -> BaseException:
    """The first rank's error inside DCP's CheckpointException (or ``exc`` itself)."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


# --- checkpoint_id=, items, empty state dicts ---------------------------------


def test_checkpoint_id_argument_moves_both_backends(tmp_path):
    dcp.save(_state(), checkpoint_id=tmp_path / "c", storage_writer=VolumeWriter(tmp_path / "x"))
    assert (tmp_path / "c" / ".metadata").is_file() and not (tmp_path / "x").exists()
    got = _blank()
    dcp.load(got, checkpoint_id=tmp_path / "c", storage_reader=VolumeReader(tmp_path / "x"))
    _assert_loaded(got)


def test_checkpoint_id_that_is_a_file_is_rejected(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        dcp.save(_state(), checkpoint_id=tmp_path / "f", storage_writer=VolumeWriter(tmp_path))


@pytest.mark.parametrize("writer", ["volume", "torch"])
def test_bytes_and_python_items_round_trip(tmp_path, writer):
    make = VolumeWriter if writer == "volume" else dcp.FileSystemWriter
    dcp.save(_state(), storage_writer=make(tmp_path / "c"))
    got = _blank()
    dcp.load(got, storage_reader=VolumeReader(tmp_path / "c"))
    _assert_loaded(got)


def test_empty_state_dict_round_trips_both_ways(tmp_path):
    dcp.save({}, storage_writer=VolumeWriter(tmp_path / "v"))
    dcp.save({}, storage_writer=dcp.FileSystemWriter(tmp_path / "t"))
    for path in ("v", "t"):
        for reader in (VolumeReader, dcp.FileSystemReader):
            got: dict = {}
            dcp.load(got, storage_reader=reader(tmp_path / path))
            assert got == {}


# --- validate_checkpoint_id ----------------------------------------------------


@pytest.mark.parametrize("cls", [VolumeWriter, VolumeReader])
def test_validate_checkpoint_id_accepts_only_what_can_be_opened(tmp_path, cls):
    (tmp_path / "file").write_text("x")
    (tmp_path / "ckpt").mkdir()
    assert cls.validate_checkpoint_id(str(tmp_path / "ckpt"))
    assert cls.validate_checkpoint_id(tmp_path / "new" / "step_1")  # created by the save
    assert cls.validate_checkpoint_id(f"file://{tmp_path}/ckpt")
    assert cls.validate_checkpoint_id(f"memory://nbtools-{uuid.uuid4().hex}/c")
    assert not cls.validate_checkpoint_id("abc://abc.abc")  # no such fsspec protocol
    assert not cls.validate_checkpoint_id(str(tmp_path / "file"))
    assert not cls.validate_checkpoint_id(str(tmp_path / "file" / "below"))


@pytest.mark.parametrize("cls", [VolumeWriter, VolumeReader])
def test_validate_checkpoint_id_rejects_protocols_whose_package_is_missing(cls):
    import fsspec

    missing = [p for p in ("s3", "gcs", "abfs", "hf", "oci") if not _installed(fsspec, p)]
    if not missing:
        pytest.skip("every probed fsspec protocol is installed here")
    assert not cls.validate_checkpoint_id(f"{missing[0]}://bucket/run/step_1")


def _installed(fsspec, protocol: str) -> bool:
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return False
    return True


@pytest.mark.parametrize(
    "ours, theirs",
    [(VolumeWriter, dcp.FileSystemWriter), (VolumeReader, dcp.FileSystemReader)],
)
def test_validate_checkpoint_id_agrees_with_pytorch_on_local_paths(tmp_path, ours, theirs):
    # (Below a file, PyTorch says True and the save then fails; nbtools says False.)
    (tmp_path / "ckpt").mkdir()
    for probe in ("abc://abc.abc", str(tmp_path / "a" / "b"), str(tmp_path / "ckpt")):
        assert ours.validate_checkpoint_id(probe) == theirs.validate_checkpoint_id(probe), probe


# --- rank-local checkpoints (use_collectives=False) in one process -------------


def test_rank_local_save_publishes_rank_metadata_only(tmp_path):
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "c"), use_collectives=False)
    names = sorted(os.listdir(tmp_path / "c"))
    assert names == ["__0.metadata", "__0_0.distcp", "__0_1.distcp"]
    md = pickle.loads((tmp_path / "c" / "__0.metadata").read_bytes())
    assert all(info.checksum.startswith("crc32:") for info in md.storage_data.values())
    for reader in (VolumeReader, dcp.FileSystemReader):
        got = _blank()
        dcp.load(got, storage_reader=reader(tmp_path / "c"))
        _assert_loaded(got)


def test_read_metadata_takes_the_rank(tmp_path):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(tmp_path / "c"), use_collectives=False)
    reader = VolumeReader(tmp_path / "c")
    assert set(reader.read_metadata(rank=0).state_dict_metadata) >= {"w", "blob"}
    with pytest.raises(CheckpointNotFoundError, match=r"__3\.metadata"):
        reader.read_metadata(rank=3)
    with pytest.raises(CheckpointNotFoundError, match="use_collectives=False"):
        reader.read_metadata()


def test_collective_save_into_a_rank_local_checkpoint_is_refused(tmp_path):
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "c"), use_collectives=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    with pytest.raises(BaseException) as info:
        dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "c"))
    assert "Checkpoint already exists" in str(_failure(info.value))
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before


def test_refusal_keeps_pytorchs_wording(tmp_path):
    # Rank-local saves cannot replace a checkpoint at once (one metadata per rank).
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=VolumeWriter(path), use_collectives=False)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(), storage_writer=VolumeWriter(path), use_collectives=False)
    err = _failure(info.value)
    assert isinstance(err, CheckpointError) and isinstance(err, RuntimeError)
    assert "Checkpoint already exists" in str(err)


# --- diagnostics: another save versus damage -----------------------------------


def test_file_rewritten_by_another_save_is_not_called_damage(tmp_path):
    # Two saves of the same shapes whose files share names (colliding prefixes):
    # the second one's file replaces the first's.
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "a", thread_count=1))
    other = _state()
    other["w"] = other["w"] + 1
    dcp.save(other, storage_writer=VolumeWriter(tmp_path / "b", thread_count=1))
    (tmp_path / "a" / "__0_0.distcp").write_bytes((tmp_path / "b" / "__0_0.distcp").read_bytes())
    with pytest.raises(BaseException) as info:
        dcp.load(_blank(), storage_reader=VolumeReader(tmp_path / "a"))
    err = _failure(info.value)
    assert isinstance(err, CorruptCheckpointError)
    assert "written again by another nbtools save" in str(err)
    assert "damaged in transfer" not in str(err)


def test_damage_is_still_reported_as_damage(tmp_path):
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "a", thread_count=1))
    shard = tmp_path / "a" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(BaseException) as info:
        dcp.load(_blank(), storage_reader=VolumeReader(tmp_path / "a"))
    assert "damaged in transfer or on disk" in str(_failure(info.value))


@pytest.mark.parametrize("use_collectives", [True, False])
def test_save_whose_files_another_save_replaced_does_not_publish(tmp_path, use_collectives):
    path = tmp_path / "c"
    other = _state()
    other["step"] = 99

    class SecondSaveInterleaved(VolumeWriter):
        """Lets a second save run in the same directory after this one wrote its files."""

        def finish(self, metadata, results):
            dcp.save(other, storage_writer=VolumeWriter(path), use_collectives=use_collectives)
            super().finish(metadata, results)

    with pytest.raises(BaseException) as info:
        dcp.save(
            _state(), storage_writer=SecondSaveInterleaved(path), use_collectives=use_collectives
        )
    err = _failure(info.value)
    assert isinstance(err, CheckpointError) and "lost data before it could publish" in str(err)
    got = _blank()
    dcp.load(got, storage_reader=VolumeReader(path))  # the second save's checkpoint is intact
    assert got["step"] == 99


# --- stream extensions -----------------------------------------------------------


def _xor_extension():
    """A stream extension defined where it is used, as in a notebook cell."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class _Xor(io.RawIOBase):
        def __init__(self, raw, writing: bool) -> None:
            super().__init__()
            self.raw, self.writing = raw, writing

        def readable(self) -> bool:
            return not self.writing

        def writable(self) -> bool:
            return self.writing

        def write(self, b) -> int:
            self.raw.write(bytes(x ^ 0x5A for x in bytes(b)))
            return len(b)

        def readinto(self, b) -> int:
            data = self.raw.read(len(b))
            b[: len(data)] = bytes(x ^ 0x5A for x in data)
            return len(data)

        def close(self) -> None:
            if self.writing:
                self.raw.close()  # FileSystemWriter's wrapper flushes and keeps the file open
            super().close()

    class Xor(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "nbtools-test.xor"

        @staticmethod
        def from_descriptor(version: str) -> Xor:
            return Xor()

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output):
            return _Xor(output, True)

        def transform_from(self, input):
            return _Xor(input, False)

    return Xor


@pytest.mark.parametrize("stage", [False, True])
def test_zstandard_checkpoint_from_pytorch_loads(tmp_path, stage):
    if not ZStandard.is_available():
        pytest.skip("neither zstandard nor pyzstd is installed")
    dcp.save(
        _state(), storage_writer=dcp.FileSystemWriter(tmp_path / "c", _extensions=[ZStandard()])
    )
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    assert all(i.transform_descriptors == ["stream.zstd/1"] for i in md.storage_data.values())
    got = _blank()
    dcp.load(got, storage_reader=VolumeReader(tmp_path / "c", stage=stage))
    _assert_loaded(got)


def test_extension_from_the_users_registry_is_applied(tmp_path):
    xor = _xor_extension()
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(tmp_path / "c", _extensions=[xor()]))
    registry = ExtensionRegistry()
    registry.register(xor)
    got = _blank()
    dcp.load(got, storage_reader=VolumeReader(tmp_path / "c", _extension_registry=registry))
    _assert_loaded(got)


def test_unknown_extension_is_refused_by_name_before_loading(tmp_path):
    dcp.save(
        _state(),
        storage_writer=dcp.FileSystemWriter(tmp_path / "c", _extensions=[_xor_extension()()]),
    )
    got = _blank()
    with pytest.raises(BaseException) as info:
        dcp.load(got, storage_reader=VolumeReader(tmp_path / "c"))
    err = _failure(info.value)
    assert isinstance(err, CheckpointError) and not isinstance(err, CorruptCheckpointError)
    assert "'nbtools-test.xor/1'" in str(err) and "_extension_registry" in str(err)
    assert not got["w"].any() and got["step"] == 0  # nothing was loaded


def test_pathlib_and_str_ids_are_the_same_checkpoint(tmp_path):
    dcp.save(_state(), storage_writer=VolumeWriter(pathlib.Path(tmp_path / "c")))
    assert VolumeReader(str(tmp_path / "c")).read_metadata().storage_meta.checkpoint_id == str(
        tmp_path / "c"
    )
