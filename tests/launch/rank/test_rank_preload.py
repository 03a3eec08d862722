"""A spare rank's preload: the modules a call's payload refers to are imported, and nothing
of the payload runs (its objects are made only once the process is a rank)."""

from __future__ import annotations

import cloudpickle

from nbtools.launch._rank._heal import preload


class _Trap:
    """Unpickling it would run ``_spring`` (user code): the preload must not."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_spring, (self.path,))


def _spring(path: str) -> None:
    with open(path, "w") as fh:
        fh.write("unpickled")


def test_the_modules_a_payload_refers_to_are_imported_and_nothing_of_it_runs(tmp_path):
    import tabnanny

    def fn(x):
        return tabnanny.check, x

    trap = tmp_path / "sprung"
    payload = cloudpickle.dumps((fn, (_Trap(str(trap)),), {}))
    modules = preload(payload)
    assert "tabnanny" in modules, modules
    assert not trap.exists()


def test_a_payload_that_is_not_a_pickle_imports_nothing():
    assert preload(b"not a pickle at all") == []
