"""The torch boundary: one test per private torch name nbtools uses.

Each test checks that the installed torch still provides the name as nbtools
calls it (no fallback taken, nothing logged), and that the fallback gives the
same result, so a torch release that renames the name fails here by name
instead of breaking an import or silently slowing a reader. The last test
keeps every private torch access inside ``nbtools/_torch_compat.py``.
"""

from __future__ import annotations

import ast
import io
import logging
import os
import pickle
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from nbtools import _torch_compat as compat

ROOT = Path(__file__).resolve().parents[1] / "nbtools"
# Some torch releases create a temporary directory on the first use of their state-dict
# utilities (a one-time set-up); do it at collection so no test is blamed for it.
compat.create_cpu_state_dict({"w": torch.zeros(1)}, pin_memory=False)


@pytest.fixture
def no_fallback(caplog):
    """Fails the test when any fallback was taken (each one logs a warning)."""
    caplog.set_level(logging.INFO, logger="nbtools.torch")
    yield
    notes = [r.getMessage() for r in caplog.records if r.name == "nbtools.torch"]
    assert notes == [], f"torch {torch.__version__} lacks a private name: {notes}"


def _state() -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.int64)},
        "opt": {"state": {0: {"momentum": torch.full((2,), 0.5)}}, "lr": [0.1, (1, 2)]},
        "step": 4,
    }


def test_state_dict_utils_create_and_copy(no_fallback):
    state = _state()
    buffers = compat.create_cpu_state_dict(state, pin_memory=False)
    copied = compat.copy_state_dict(state, buffers, non_blocking=False)
    own = compat._own_copy(state, compat._own_create(state, False), False)
    for result in (copied, own):
        torch.testing.assert_close(result["model"], state["model"])
        torch.testing.assert_close(result["opt"]["state"], state["opt"]["state"])
        assert result["step"] == 4 and result["opt"]["lr"] == [0.1, (1, 2)]
    # The copy lives in the reused buffers, not in the source tensors.
    assert copied["model"]["w"].data_ptr() == buffers["model"]["w"].data_ptr()
    assert copied["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()


def test_fallback_staging_refuses_distributed_tensors():
    class Sub(torch.Tensor):
        pass

    with pytest.raises(compat.UnsupportedTorchError, match=torch.__version__.split("+")[0]):
        compat._own_create({"w": torch.zeros(2).as_subclass(Sub)}, False)


def test_pin_memory(no_fallback):
    batch = {"x": [1, "a"], "y": "b", "z": 2.0}
    assert compat.pin_memory(batch) == batch == compat._own_pin(batch)
    if torch.cuda.is_available():
        pinned = compat.pin_memory({"t": [torch.zeros(2)]})
        assert pinned["t"][0].is_pinned()
        assert compat._own_pin({"t": [torch.zeros(2)]})["t"][0].is_pinned()


@pytest.mark.parametrize(
    ("offsets", "sizes"), [((0, 0), (4, 6)), ((1, 2), (2, 3)), ((3, 0), (1, 6))]
)
def test_narrow_tensor_by_index_matches_torch(offsets, sizes):
    tensor = torch.arange(24.0).reshape(4, 6)
    ours = compat.narrow_tensor_by_index(tensor, offsets, sizes)
    theirs = compat._lookup("torch.distributed._shard._utils", "narrow_tensor_by_index")
    expected = tensor[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
    torch.testing.assert_close(ours, expected)
    if theirs is not None:
        torch.testing.assert_close(ours, theirs(tensor, offsets, sizes))


def test_storage_info_is_the_dcp_record_the_allow_list_names():
    from nbtools.checkpoint._storage._safe_pickle import _ALLOWED, load_metadata

    cls = compat.storage_info_class()
    assert (cls.__module__, cls.__name__) in _ALLOWED
    info = cls("__0_0.distcp", 3, 5)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 3, 5)
    from torch.distributed.checkpoint.metadata import Metadata

    loaded = load_metadata(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={"k": info})))
    assert loaded.storage_data["k"] == info


def test_stream_extensions():
    registry = compat.extension_registry()
    base = compat.stream_transform_extension_class()
    zstd = compat._lookup("torch.distributed.checkpoint._extension", "ZStandard")
    assert zstd is not None and issubclass(zstd, base)
    assert hasattr(registry, "from_descriptor_list")


def _saved(tensor: torch.Tensor) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    buf.seek(0)
    return buf


def test_storage_data_offset():
    tensor = torch.arange(10, dtype=torch.float32)
    record = _saved(tensor)
    meta = torch.load(record, map_location="meta", weights_only=True)
    private = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    # torch sets it on meta loads since after 2.9; before, the zipfile stand-in is used.
    newest = torch.torch_version.TorchVersion(torch.__version__) >= compat.TESTED_TORCH[-1]
    assert isinstance(private, int) or not newest
    offset = compat.storage_data_offset(meta, record)
    raw = record.getvalue()[offset : offset + tensor.numel() * 4]
    assert raw == tensor.numpy().tobytes()
    # The zipfile stand-in finds the same place.
    info = compat._zip_record(record, "/data/0")
    assert compat._zip_data_offset(record, info) == offset


def test_saved_byteorder(no_fallback):
    record = _saved(torch.ones(3))
    assert compat.saved_byteorder(record) == sys.byteorder
    with zipfile.ZipFile(record) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/byteorder"))
        assert archive.read(name).decode() == sys.byteorder


def test_dataloader_iterator_and_worker_shutdown(no_fallback):
    import psutil
    from torch.utils.data import DataLoader

    class Numbers(torch.utils.data.Dataset):  # defined here, as in a notebook cell
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            return i

    loader = DataLoader(Numbers(), batch_size=2, num_workers=1, persistent_workers=True)
    assert compat.loader_iterator(loader) is None
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    iterator = compat.loader_iterator(loader)
    assert iterator is not None and psutil.Process().children()
    assert compat.take_loader_iterator(loader) is iterator
    assert compat.loader_iterator(loader) is None
    workers = [w.pid for w in iterator._workers]
    compat.shutdown_workers(iterator)
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in workers
    )


def test_stager_needs_no_synchronize_call():
    from torch.distributed.checkpoint.staging import AsyncStager

    from nbtools.checkpoint._host_buffers import ReusableStager

    assert isinstance(AsyncStager.__dict__.get("should_synchronize_after_execute"), property)
    assert ReusableStager().should_synchronize_after_execute is False


def test_torch_metadata_loader_is_used_where_torch_has_one(monkeypatch):
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import Metadata

    from nbtools.checkpoint._storage._safe_pickle import load_metadata
    from nbtools.errors import UnsafeCheckpointError

    has_own = hasattr(filesystem, "add_safe_metadata_globals")
    assert (compat.torch_metadata_loader() is not None) == has_own
    if not has_own:
        # Stand in for a torch that restricts .metadata itself: it must be the one used.
        calls = []

        def restricted(stream):
            calls.append(1)
            data = stream.read()
            if b"posix" in data or b"os\n" in data:
                raise pickle.UnpicklingError("Blocked unpickling")
            return pickle.loads(data)

        monkeypatch.setattr(filesystem, "add_safe_metadata_globals", lambda *a: None, raising=False)
        monkeypatch.setattr(filesystem, "_restricted_metadata_load", restricted, raising=False)
    good = pickle.dumps(Metadata(state_dict_metadata={}))
    assert isinstance(load_metadata(good), Metadata)

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    with pytest.raises(UnsafeCheckpointError):
        load_metadata(pickle.dumps(Evil()))
    if not has_own:
        assert calls == [1, 1]


def test_missing_name_error_names_the_torch_version():
    err = compat._missing("torch.something._private", "testing")
    assert torch.__version__ in str(err) and compat.TESTED_TORCH[0] in str(err)
    assert isinstance(err, RuntimeError)


# --- the boundary ---------------------------------------------------------------------------

# Private members of torch objects (not reachable as ``torch._x`` paths), as attributes or
# as names given to getattr. (The metadata allow-list names private classes as strings:
# those are names recorded in files, not accesses.)
_PRIVATE_MEMBERS = {
    "_checkpoint_offset",
    "_shutdown_workers",
    "_synchronize_after_execute",
    "_iterator",
    "_element_size",
}
_PRIVATE_ATTRIBUTES = _PRIVATE_MEMBERS | {"_StorageInfo"}


def _torch_bound_names(tree: ast.AST) -> set[str]:
    """Names a module binds to torch modules or objects (``dist``, ``c10d``, ``torch``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("torch")
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("torch")
        ):
            names |= {a.asname or a.name for a in node.names}
    return names


def _torch_assignments(tree: ast.AST) -> list[ast.Attribute]:
    """``x.attr = ...`` (and ``setattr(x, ...)``) where ``x`` is rooted at a torch name."""
    bound = _torch_bound_names(tree)
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets += node.targets if isinstance(node, ast.Assign) else [node.target]
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args
        ):
            targets.append(ast.Attribute(value=node.args[0], attr="<setattr>", lineno=node.lineno))
    found = []
    for target in targets:
        if not isinstance(target, ast.Attribute):
            continue
        inner = target.value
        while isinstance(inner, ast.Attribute):
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in bound:
            found.append(target)
    return found


def _private_torch_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = [f"{path.name}:{t.lineno} assigns .{t.attr}" for t in _torch_assignments(tree)]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("torch")
        ):
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts) or any(
                a.name.startswith("_") for a in node.names
            ):
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(
                    p.startswith("_") for p in alias.name.split(".")
                ):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            rooted = isinstance(inner, ast.Name) and inner.id == "torch"
            if (
                rooted and any(a.startswith("_") for a in chain)
            ) or node.attr in _PRIVATE_ATTRIBUTES:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in _PRIVATE_MEMBERS:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
    return found


def test_private_torch_names_only_in_the_boundary_module():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "_torch_compat.py":
            continue
        offenders += [f"{path.relative_to(ROOT)}: {use}" for use in _private_torch_uses(path)]
    assert offenders == [], "private torch names outside nbtools/_torch_compat.py"


def test_the_boundary_check_sees_assignments_to_torch_attributes(tmp_path):
    module = tmp_path / "shim.py"
    module.write_text(
        "import torch.distributed as dist\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "def patch(f):\n"
        "    dist.init_process_group = f\n"
        "    setattr(c10d, 'init_process_group', f)\n"
        "    local = object()\n"
        "    local.attr = f\n"
    )
    uses = _private_torch_uses(module)
    assert uses == ["shim.py:4 assigns .init_process_group", "shim.py:5 assigns .<setattr>"]


def test_init_process_group_guard_skips_a_second_group_once_and_keeps_torch_first(tmp_path):
    import torch.distributed as dist

    skipped = []
    saved = dist.init_process_group, dist.distributed_c10d.init_process_group
    try:
        compat.guard_init_process_group("gloo", lambda req, active: skipped.append((req, active)))
        compat.guard_init_process_group("gloo", lambda req, active: skipped.append("twice"))
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )  # torch's own call: the group forms
        assert dist.is_initialized()
        assert dist.init_process_group("nccl") is None
        assert dist.init_process_group(backend="nccl") is None
        assert dist.init_process_group("gloo") is None
        assert skipped == [("nccl", "gloo")]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group, dist.distributed_c10d.init_process_group = saved


def test_fork_start_method_is_restored_from_a_forced_choice(no_fallback):
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method("forkserver", force=True)
        compat.restore_fork_start_method()
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(before, force=True)


def test_process_exitcodes_of_an_elastic_context(no_fallback, tmp_path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    ctx = start_processes(
        name="exitcodes",
        entrypoint=os._exit,  # a function entry point: torch's MultiprocessContext
        args={0: (0,), 1: (3,)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        start_method="fork",
    )
    try:
        while ctx.wait(0.2) is None:
            pass
        codes = compat.process_exitcodes(ctx)
    finally:
        ctx.close()
    assert codes == {0: 0, 1: 3}


def test_dtensor_shard_offset_is_where_the_local_shard_starts(no_fallback, tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        whole = torch.arange(12.0).reshape(4, 3)
        shard = distribute_tensor(whole, mesh, [Shard(0)])
        assert compat.dtensor_shard_offset(shard) == [0, 0]
    finally:
        dist.destroy_process_group()
