"""Packing functions and arguments for the ranks, and naming what cannot travel."""

from __future__ import annotations

import pickle
import threading

import pytest

from nbtools.errors import PicklingError
from nbtools.launch._payload import pack

# Functions of a notebook live in ``__main__``, so cloudpickle sends them by value
# together with the globals they use; this namespace plays such a kernel.
_CELLS = """
import threading
lock = threading.Lock()
gen = (i for i in range(3))

def uses_lock():
    with lock:
        return 1

def uses_generator():
    return next(gen)

def calls_helper():
    return uses_lock()
"""


def _notebook_namespace() -> dict:
    namespace = {"__name__": "__main__"}
    exec(compile(_CELLS, "<cell>", "exec"), namespace)
    return namespace


def test_closures_lambdas_and_local_classes_travel():
    class Point:
        def __init__(self, x):
            self.x = x

    offset = 10
    scale = lambda v: v * 2  # noqa: E731

    def fn(p):
        return scale(p.x) + offset

    loaded_fn, args, kwargs = pickle.loads(pack(fn, (Point(4),), {}))
    assert loaded_fn(*args, **kwargs) == 18


def test_closure_lock_is_named():
    lock = threading.Lock()

    def fn():
        with lock:
            return 1

    with pytest.raises(PicklingError, match=r"closure variable 'lock' \(a lock\)"):
        pack(fn, (), {})


def test_open_file_argument_is_named(tmp_path):
    def fn(out, n):
        return n

    with open(tmp_path / "log.txt", "w") as fh:
        with pytest.raises(PicklingError, match=r"argument 'out' \(an open file\)") as info:
            pack(fn, (fh,), {"n": 1})
    assert isinstance(info.value, TypeError)
    assert "inside the function" in str(info.value)


def test_globals_are_named_through_helper_functions():
    cells = _notebook_namespace()
    with pytest.raises(PicklingError, match=r"global variable 'gen' \(a generator\)"):
        pack(cells["uses_generator"], (), {})
    with pytest.raises(
        PicklingError,
        match=r"global variable 'uses_lock' -> global variable 'lock' \(a lock\)",
    ):
        pack(cells["calls_helper"], (), {})


def test_default_value_is_named():
    def fn(x, guard=threading.Lock()):
        return x

    with pytest.raises(PicklingError, match=r"default of parameter 'guard'"):
        pack(fn, (1,), {})


def test_signature_mismatch_is_a_type_error():
    def fn(a, b):
        return a + b

    with pytest.raises(TypeError, match="fn.distributed"):
        pack(fn, (1,), {"c": 2})
