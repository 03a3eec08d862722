"""The settings table lists every ``NBTOOLS_*`` variable the package reads, and reads them checked."""

from __future__ import annotations

import pathlib
import re

import pytest

import nbtools
from nbtools._internal import settings

PACKAGE = pathlib.Path(nbtools.__file__).parent
NAME = re.compile(r"\bNBTOOLS_[A-Z0-9_]*[A-Z0-9]\b")


def _names_in_source() -> dict[str, str]:
    """Each NBTOOLS_ name in the package's source files -> the first file that has it."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".js") or path.name == "settings.py":
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, str(path.relative_to(PACKAGE.parent)))
    return found


def test_the_table_lists_every_variable_the_package_names():
    found = _names_in_source()
    assert len(found) >= 10, "the scan found too few names to be looking at the package"
    listed = {setting.name for setting in settings.SETTINGS}
    missing = {name: where for name, where in found.items() if name not in listed}
    assert not missing, f"add these to nbtools/_internal/settings.py: {missing}"
    unused = listed - set(found)
    assert not unused, f"nothing in the package reads {sorted(unused)}: remove them from the table"


def test_each_setting_is_described_once():
    names = [setting.name for setting in settings.SETTINGS]
    assert len(names) == len(set(names))
    for setting in settings.SETTINGS:
        assert setting.name.startswith("NBTOOLS_")
        assert setting.type and setting.default and setting.area
        assert setting.meaning.endswith("."), setting.name


def test_read_parses_a_value_and_names_the_variable_of_a_bad_one():
    env = {"NBTOOLS_STRAGGLER_THRESHOLD": "0.5", "NBTOOLS_CACHE_MIN_FREE_BYTES": "-1"}
    assert settings.read("NBTOOLS_STRAGGLER_THRESHOLD", env) == 0.5
    assert settings.read("NBTOOLS_STRAGGLER_WINDOW_S", env) is None
    with pytest.raises(
        ValueError, match=r"NBTOOLS_CACHE_MIN_FREE_BYTES='-1'.*must not be negative"
    ):
        settings.read("NBTOOLS_CACHE_MIN_FREE_BYTES", env)
    with pytest.raises(KeyError, match="NBTOOLS_NOPE is not an nbtools setting"):
        settings.read("NBTOOLS_NOPE", env)
