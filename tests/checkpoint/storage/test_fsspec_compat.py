"""The fsspec boundary: one test per private fsspec name nbtools uses.

Each test checks that the installed fsspec still provides the name as
``nbtools/checkpoint/_storage/_fsspec_compat.py`` calls it, so an fsspec release
that renames it fails here by name. The last test keeps every private fsspec
access inside that module.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import fsspec
import pytest
from fsspec.asyn import AsyncFileSystem

from nbtools.checkpoint._storage._fsspec_compat import cat_range
from nbtools.checkpoint._storage._target import FsspecTarget, LocalTarget

s3fs = pytest.importorskip("s3fs")
from test_s3 import BUCKET, s3  # noqa: E402, F401 - the loopback S3 fixture

ROOT = Path(__file__).resolve().parents[3] / "nbtools"
DATA = bytes(range(256)) * 64


def test_async_cat_file_takes_a_range_and_a_timeout(s3):  # noqa: F811
    # AsyncFileSystem._cat_file: the coroutine behind cat_file, whose timeout cancels the request.
    assert isinstance(s3, AsyncFileSystem) and inspect.iscoroutinefunction(s3._cat_file)
    s3.pipe_file(f"{BUCKET}/f", DATA)
    assert cat_range(s3, f"{BUCKET}/f", 100, 4000, timeout=30.0) == DATA[100:4000]
    assert FsspecTarget(f"s3://{BUCKET}").read_range("f", 7, 9, 30.0) == DATA[7:9]


def test_a_timed_out_async_request_raises_fsspecs_own_timeout_error():
    # cat_range knows fsspec's timeout by its class name; the class must still exist.
    from fsspec.exceptions import FSTimeoutError

    assert issubclass(FSTimeoutError, Exception)
    assert FSTimeoutError.__name__ == "FSTimeoutError"


def test_synchronous_filesystems_read_through_public_cat_file():
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/nbtools-compat/f", DATA)
    try:
        assert cat_range(fs, "/nbtools-compat/f", 10, 20, timeout=1.0) == DATA[10:20]
        assert (
            FsspecTarget("memory://nbtools-compat").read_range("f", 250, 300, 1.0) == DATA[250:300]
        )
    finally:
        fs.rm("/nbtools-compat", recursive=True)


def test_local_ranges_read_with_pread_and_stop_at_the_end(tmp_path):
    (tmp_path / "f").write_bytes(DATA)
    target = LocalTarget(tmp_path)
    assert target.read_range("f", 5, 70, 1.0) == DATA[5:70]
    assert target.read_range("f", len(DATA) - 3, len(DATA) + 10, 1.0) == DATA[-3:]


def _private_fsspec_uses(path: Path) -> list[str]:
    """Private attributes read off a filesystem (``fs._x``, ``self.fs._x``, ``target.fs._x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            inner = node.value
            name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
            if name == "fs":
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_private_fsspec_names_only_in_the_boundary_module():
    offenders = [
        f"{path.relative_to(ROOT)}: {use}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "_fsspec_compat.py"
        for use in _private_fsspec_uses(path)
    ]
    assert offenders == [], offenders


def test_the_check_sees_a_private_fsspec_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(target):\n    return target.fs._cat_file\n")
    assert _private_fsspec_uses(probe) == ["probe.py:2 ._cat_file"]
