"""``after_import``: the one way nbtools changes a library's module right after it first runs."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

from nbtools._internal import hooks


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package whose ``__init__`` takes a name from its submodule, as IPython.display does."""
    root = tmp_path / "nbt_after_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("from nbt_after_pkg.impl import value\n")
    (root / "impl.py").write_text("value = 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "nbt_after_pkg"
    for name in [n for n in sys.modules if n.startswith("nbt_after_pkg")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _watches() -> list:
    return [f for f in sys.meta_path if isinstance(f, hooks._ImportWatch)]


def test_the_function_runs_once_right_after_the_module_and_before_its_parent_takes_names(
    package,
):
    calls = []

    def patch(module):
        calls.append(module.__name__)
        module.value = "patched"

    hooks.after_import(f"{package}.impl", patch)
    hooks.after_import(f"{package}.impl", patch)  # registered twice: runs once
    assert len(_watches()) == 1 and package not in sys.modules  # nothing imported for it
    parent = importlib.import_module(package)
    assert parent.value == "patched" and calls == [f"{package}.impl"]
    assert _watches() == []  # nothing waits any more: the finder is gone
    assert sys.modules[f"{package}.impl"].__spec__.loader.__class__.__name__ != "_Loader"


def test_an_imported_module_gets_the_function_at_once(package):
    importlib.import_module(package)
    seen = []
    hooks.after_import(f"{package}.impl", lambda module: seen.append(module.value))
    assert seen == ["original"] and _watches() == []


def test_a_failing_function_is_logged_and_never_fails_the_import(package, caplog):
    def broken(module):
        raise RuntimeError("no such attribute in this version")

    hooks.after_import(f"{package}.impl", broken)
    with caplog.at_level(logging.WARNING, logger="nbtools"):
        assert importlib.import_module(package).value == "original"
    assert (
        "no such attribute in this version" in caplog.text and "nbt_after_pkg.impl" in caplog.text
    )


def test_every_module_patch_of_a_rank_goes_through_the_one_finder(monkeypatch):
    from nbtools.launch._rank import _display, _inrank, _trainer_hooks

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("transformers.trainer", "lightning.pytorch.trainer.trainer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed.checkpoint.state_dict_saver", raising=False)
    before = [type(f) for f in sys.meta_path]
    _trainer_hooks.install()
    _inrank.separate_async_saves()
    _display.install()  # no rich output asked for here: nothing to patch
    added = [type(f) for f in sys.meta_path if type(f) not in before]
    assert added == [hooks._ImportWatch]
    watch = _watches()[0]
    assert {
        "transformers.trainer",
        "lightning.pytorch.trainer.trainer",
        "torch.distributed.checkpoint.state_dict_saver",
    } <= set(watch._waiting)
    watch._waiting.clear()
