"""Packing the user's function and arguments for the ranks, with errors that name the culprit.

Everything travels by cloudpickle, so functions, closures, lambdas and classes
defined in notebook cells work. Packing happens before any process starts; when
it fails, the closure, globals, defaults and arguments are pickled one by one to
name the variable that cannot travel. :func:`pack_push` pickles the names a
pool pushes, large tensors out of band; :func:`unpack_values` loads what the ranks send back.
"""

from __future__ import annotations

import inspect
import io
import keyword
import pickle
import socket
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cloudpickle

from nbtools.errors import DistributedError, PicklingError
from nbtools.launch._results import Framed, find_unpicklable
from nbtools.launch._results import pack as pack_result

__all__ = ["pack", "pack_push", "unpack_values"]

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def pack(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """Cloudpickle ``(fn, args, kwargs)``; raise :class:`PicklingError` naming what cannot travel.

    Raises:
        TypeError: the arguments do not match ``fn``'s signature.
        PicklingError: something cannot be pickled; the message names it.
    """
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{_name(fn)}.distributed{_describe_call(args, kwargs)}: {exc}") from None
    except ValueError:
        pass  # no signature available (some builtins): let the rank report it
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:  # pickling raises many types
        culprit = _find_culprit(fn, args, kwargs)
        if culprit is None:
            raise PicklingError(
                f"{_name(fn)} or its arguments cannot be sent to the ranks: {exc}. "
                "Ranks receive them by cloudpickle; create unpicklable objects inside the function."
            ) from exc
        where, value, error = culprit
        raise PicklingError(
            f"{where} ({_kind(value)}) cannot be sent to the ranks: {error}. Ranks receive the "
            "function and its arguments by cloudpickle; create such objects inside the function "
            "instead, or pass something picklable (a path instead of an open file)."
        ) from exc


def pack_push(names: dict[str, Any] | None, values: dict[str, Any]) -> Framed:
    """Pickle the names ``RankPool.push`` sets (``names`` merged with ``values``) once.

    Large tensors and arrays stay out of band, as in a rank's return value
    (:func:`nbtools.launch._results.pack`): the channel sends them from their own
    memory, and each rank maps what it receives without another copy.

    Raises:
        TypeError: ``names`` is neither None nor a dict.
        ValueError: a name is not a Python name.
        PicklingError: a value cannot be pickled; the message names it and the part inside it.
    """
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"push() takes a dict or keyword arguments, got {type(names).__name__}")
    merged = {**(names or {}), **values}
    for name in merged:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"push(): {name!r} is not a Python name")
    try:
        return pack_result(merged)
    except Exception as exc:  # pickling raises many types
        for name, value in merged.items():
            where = find_unpicklable(value, name)
            if where is not None:
                inside = where[len(name) : len(name) + 1] in ("[", ".")
                why = f"{where} cannot be pickled" if inside else _pickle_error(value)
                raise PicklingError(
                    f"push(): {name!r} ({type(value).__qualname__}) cannot be sent to the ranks: "
                    f"{why}. Create it on the ranks instead (pool.execute or %%distributed)."
                ) from None
        raise PicklingError(f"push(): the values cannot be sent to the ranks: {exc}") from exc


def unpack_values(blobs: Iterable[tuple[int, bytes | Framed]], what: str) -> list[Any]:
    """Unpickle each ``(rank, blob)`` the ranks sent back, in the order given.

    A blob is pickle bytes, or a :class:`~nbtools.launch._results.Framed` pickle
    with its out-of-band buffers (a local rank's return value).

    ``what`` names one value in the error, followed by the rank (``"the value from rank"``).

    Raises:
        DistributedError: a value cannot be loaded here (a class the notebook lacks).
    """
    values = []
    for rank, blob in blobs:
        try:
            values.append(blob.loads() if isinstance(blob, Framed) else pickle.loads(blob))
        except Exception as exc:  # any unpickling error means the same
            raise DistributedError(
                f"{what} {rank} cannot be loaded here: {type(exc).__name__}: {exc}. "
                "Return plain data instead."
            ) from exc
    return values


def _find_culprit(fn: Callable, args: tuple, kwargs: dict) -> tuple[str, Any, str] | None:
    for where, value in _candidates(fn, args, kwargs):
        error = _pickle_error(value)
        if error is None:
            continue
        if isinstance(value, types.FunctionType) and value is not fn:
            inner = _find_culprit(value, (), {})
            if inner is not None:
                return (f"{where} -> {inner[0]}", inner[1], inner[2])
        return (where, value, error)
    return None


def _candidates(fn: Callable, args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
        for name, value in bound.items():
            yield f"argument {name!r}", value
    except (TypeError, ValueError):
        for i, value in enumerate(args):
            yield f"positional argument {i}", value
        for name, value in kwargs.items():
            yield f"argument {name!r}", value
    target = inspect.unwrap(fn) if callable(fn) else fn
    code = getattr(target, "__code__", None)
    if code is None:
        return
    for name, cell in zip(
        code.co_freevars, getattr(target, "__closure__", None) or (), strict=False
    ):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:
            continue  # empty cell
    defaults = target.__defaults__ or ()
    positional = list(inspect.signature(target).parameters)[: code.co_argcount]
    for name, value in zip(positional[len(positional) - len(defaults) :], defaults, strict=False):
        yield f"default of parameter {name!r}", value
    for name, value in (target.__kwdefaults__ or {}).items():
        yield f"default of parameter {name!r}", value
    namespace = getattr(target, "__globals__", {})
    for name in _global_names(code):
        if name in namespace and not isinstance(namespace[name], types.ModuleType):
            yield f"global variable {name!r}", namespace[name]


def _global_names(code: types.CodeType) -> Iterator[str]:
    seen: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        for name in current.co_names:
            if name not in seen:
                seen.add(name)
                yield name
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))


def _pickle_error(value: Any) -> str | None:
    try:
        cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, io.IOBase):
        return "an open file"
    if isinstance(value, _LOCK_TYPES):
        return "a lock"
    if isinstance(value, types.GeneratorType):
        return "a generator"
    if isinstance(value, socket.socket):
        return "a socket"
    if isinstance(value, types.FunctionType):
        return f"function {value.__qualname__}"
    return f"a {type(value).__qualname__}"


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _describe_call(args: tuple, kwargs: dict) -> str:
    parts = [repr(a)[:40] for a in args] + [f"{k}={v!r}"[:40] for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"
