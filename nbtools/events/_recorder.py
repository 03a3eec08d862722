"""This rank's place in its collectives, read from torch's Flight Recorders.

torch keeps a record of the collectives each process issued: gloo's (and any
CPU backend's) through ``_dump_fr_trace_json``, NCCL's through
``_dump_nccl_trace_json``, which a CPU build of torch does not have. Both
write the same JSON (torch 2.13, format ``"version": "2.10"``; the layout is
the one torch's own analysis tools read, ``torch/distributed/flight_recorder/
components/types.py``, and its tests check, ``test/distributed/
test_c10d_nccl.py``'s ``NCCLTraceTest._verify_trace``)::

    {"version": "2.10", "comm_lib_version": "2.27.5",
     "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
     "pg_status": {"0": {"last_enqueued_collective": "7",
                         "last_started_collective": "-1",
                         "last_completed_collective": "6"}},
     "entries": [{"record_id": 6, "pg_id": 0, "process_group": ["0", "default_pg"],
                  "collective_seq_id": 7, "p2p_seq_id": 0, "op_id": 7,
                  "profiling_name": "nccl:all_reduce", "is_p2p": false,
                  "time_created_ns": ..., "time_discovered_started_ns": null,
                  "time_discovered_completed_ns": null, "duration_ms": 0.03,
                  "state": "scheduled", "retired": false, "timeout_ms": 600000,
                  "input_sizes": [[3, 4]], "input_dtypes": ["Float"],
                  "output_sizes": [[3, 4]], "output_dtypes": ["Float"],
                  "thread_id": "...", "thread_name": "..."}]}

``state`` is ``scheduled`` (issued), ``started`` (its kernel began on the GPU;
only with ``TORCH_NCCL_ENABLE_TIMING=1``, else ``last_started_collective`` stays
-1) or ``completed``; ``duration_ms`` is there only with timing on. Counters
may come as numbers or as strings.

Groups are keyed by backend and group id (``"nccl:0"``, ``"gloo:0"``): the
default group's gloo and NCCL sides share id 0. The backend is the prefix of
an entry's ``profiling_name``, else the recorder's own.

:func:`positions` turns one dump into the scalars a rank sends when the kernel
asks (``events._ask``); :func:`outside_share` measures, from the start and end
times of the collectives, the share of a recent window this rank spent outside
them: the straggler score of a GPU rank, whose wait in a collective is a spin
that /proc sees as work.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from nbtools._internal.log import get_logger

__all__ = [
    "RECORDERS",
    "MAX_GROUPS",
    "MAX_PENDING",
    "read_dumps",
    "read_positions",
    "positions",
    "outside_share",
    "device_outside",
    "gpu_utilisation",
]

_log = get_logger("events")

#: torch's dump functions and the backend their records are of, when a record does not say.
RECORDERS = (("_dump_fr_trace_json", "gloo"), ("_dump_nccl_trace_json", "nccl"))
#: Process groups answered per request.
MAX_GROUPS = 8
#: Collectives issued and not yet completed that an answer lists per group, oldest first.
MAX_PENDING = 8


def read_dumps() -> list[tuple[str, dict[str, Any]]]:
    """``(backend, trace)`` of each recorder this process has; empty when torch.distributed
    is not loaded (this module imports no torch) or no recorder can be read."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    found = []
    for name, backend in RECORDERS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue  # a CPU build has no NCCL recorder
        try:
            trace = json.loads(dump(includeCollectives=True, onlyActive=False))
        except Exception as exc:  # noqa: BLE001 - a torch without this recorder: nothing to say
            _log.debug("reading the Flight Recorder (%s) failed: %s", name, exc)
            continue
        if isinstance(trace, dict):
            found.append((backend, trace))
    return found


def read_positions() -> list[dict[str, Any]] | None:
    """This process's place in each of its process groups (see :func:`positions`), from
    every recorder it has; None when none can be read."""
    dumps = read_dumps()
    if not dumps:
        return None
    found: dict[str, dict[str, Any]] = {}
    for backend, trace in dumps:
        for position in positions(trace, backend):
            found.setdefault(position["pg"], position)  # one recorder may hold both backends
    if not found:
        # The recorder works but this rank entered no collective yet: it is at the start
        # of the default group, behind any peer that entered one.
        backend = dumps[-1][0] if any(b == "nccl" for b, _ in dumps) else dumps[0][0]
        found[f"{backend}:0"] = _position(f"{backend}:0", 0, -1, 0, "")
    ordered = sorted(found.values(), key=lambda f: (f["pg"].split(":", 1)[0] != "nccl", f["pg"]))
    utilisation = gpu_utilisation()
    for each in ordered:
        if utilisation is not None and each["pg"].startswith("nccl:"):
            each["gpu_util"] = utilisation
    return ordered[:MAX_GROUPS]


def positions(trace: dict[str, Any], backend: str) -> list[dict[str, Any]]:
    """One dict of scalars (and a short list) per process group of one recorder's dump.

    Keys: ``pg`` (``"<backend>:<group id>"``), ``enqueued``, ``started`` and
    ``completed`` (sequence numbers of the last collective issued, begun on the
    device (-1: not recorded) and finished), ``op``, ``op_seq`` and ``bytes``
    (name, number and input size of the last collective recorded) and
    ``pending``: ``"seq:op:bytes:state"`` of the collectives issued and not
    completed, oldest first and joined by ``;``, at most :data:`MAX_PENDING`
    (an event's fields are scalars).

    Args:
        trace: The parsed JSON of ``_dump_fr_trace_json`` or ``_dump_nccl_trace_json``.
        backend: The recorder's backend, for groups whose records do not name one.
    """
    status = trace.get("pg_status") or {}
    by_pg: dict[str, list[dict[str, Any]]] = {}
    backends: dict[str, str] = {}
    for entry in trace.get("entries") or []:
        if entry.get("is_p2p") or _int(entry.get("collective_seq_id")) is None:
            continue
        pg = str(entry.get("pg_id", ""))
        by_pg.setdefault(pg, []).append(entry)
        name = str(entry.get("profiling_name") or "")
        if ":" in name:
            backends[pg] = name.split(":", 1)[0]
    found = []
    for pg, values in status.items():
        pg = str(pg)
        enqueued = _int(values.get("last_enqueued_collective"))
        if enqueued is None:
            continue
        completed = _int(values.get("last_completed_collective"))
        started = _int(values.get("last_started_collective"))
        completed = max(completed if completed is not None else -1, 0)
        entries = sorted(by_pg.get(pg, []), key=lambda e: _int(e["collective_seq_id"]) or 0)
        pending = ";".join(
            [
                f"{seq}:{_op_name(e)}:{_bytes(e) if _bytes(e) is not None else ''}:"
                f"{e.get('state') or ''}"
                for e in entries
                if (seq := _int(e["collective_seq_id"]) or 0) > completed
                and e.get("state") != "completed"
            ][:MAX_PENDING]
        )
        key = f"{backends.get(pg, backend)}:{pg}"
        found.append(
            _position(
                key, max(enqueued, 0), started if started is not None else -1, completed, pending
            )
        )
        if entries:
            last = entries[-1]
            found[-1].update(
                op=_op_name(last), op_seq=_int(last["collective_seq_id"]), bytes=_bytes(last)
            )
    return found


def _position(pg: str, enqueued: int, started: int, completed: int, pending: str) -> dict[str, Any]:
    return {
        "pg": pg,
        "enqueued": enqueued,
        "started": started,
        "completed": completed,
        "op": None,
        "op_seq": None,
        "bytes": None,
        "pending": pending,
    }


def outside_share(
    trace: dict[str, Any], window_s: float, now_ns: int | None = None
) -> float | None:
    """The share of the last ``window_s`` seconds this rank spent outside collectives.

    A collective counts from its start on the device (``time_discovered_started_ns``,
    with timing on) or else from when it was issued (``time_created_ns``), to when it
    was seen completed (``time_discovered_completed_ns``; still running: now). A
    straggler enters its collectives last and so barely waits in them: its share
    outside is the highest of its group. None when the record covers too little of the
    window (fewer than two collectives in it).

    Args:
        trace: One recorder's parsed dump.
        window_s: The window, in seconds, ending now.
        now_ns: Now, on the clock of the record (``time.time_ns()``).
    """
    now = time.time_ns() if now_ns is None else now_ns
    start = now - int(window_s * 1e9)
    spans = []
    for entry in trace.get("entries") or []:
        if entry.get("is_p2p"):
            continue
        began = _int(entry.get("time_discovered_started_ns")) or _int(entry.get("time_created_ns"))
        ended = _int(entry.get("time_discovered_completed_ns"))
        if not began:
            continue
        if not ended:
            if entry.get("retired") or entry.get("state") == "completed":
                continue  # over, but not timed (gloo's record): nothing to measure
            ended = now  # still running
        if ended > start and began < now:
            spans.append((max(began, start), min(ended, now)))
    if len(spans) < 2:
        return None
    inside = 0
    reach = start
    for began, ended in sorted(spans):  # the union of the spans: overlaps count once
        if ended > reach:
            inside += ended - max(began, reach)
            reach = ended
    return max(0.0, 1.0 - inside / (now - start))


_DEVICE_EVERY_S = 5.0  # a GPU rank's share outside collectives is measured this often
_device: list[Any] = [None, -1e9, True]  # [the share last measured, when, whether to go on]


def device_outside(window_s: float) -> float | None:
    """This rank's share of the last ``window_s`` seconds outside NCCL collectives, from
    NCCL's recorder (:func:`outside_share`), measured at most every 5 s; None on a rank
    without NCCL's recorder or CUDA (a CPU build stops looking after the first call)."""
    now = time.monotonic()
    if not _device[2] or now - _device[1] < _DEVICE_EVERY_S:
        return _device[0] if _device[2] else None
    _device[1] = now
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = getattr(c10d, "_dump_nccl_trace_json", None)
    if c10d is not None and dump is None:
        _device[2] = False  # a CPU build: never
        return None
    if dump is None:
        return None
    try:
        trace = json.loads(dump(includeCollectives=True, onlyActive=False))
    except Exception as exc:  # noqa: BLE001 - the recorder is off: no share
        _log.debug("reading NCCL's Flight Recorder failed: %s", exc)
        return None
    _device[0] = outside_share(trace, window_s) if isinstance(trace, dict) else None
    return _device[0]


def gpu_utilisation(read: Callable[[], float | None] | None = None) -> float | None:
    """Percent of the last sample period this rank's GPU ran a kernel (NVML), or None on a
    CPU rank, without NVML, or when it cannot be read. ``read`` replaces the NVML read."""
    if read is not None:
        return read()
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
        return float(cuda.utilization(cuda.current_device()))
    except Exception:  # noqa: BLE001 - no NVML or no device: no tie-breaker
        return None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


_ITEM_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
}


def _bytes(entry: dict[str, Any]) -> int | None:
    """The input size of a recorded collective, from its shapes and dtypes."""
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list):
        return None
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=False):
        count = 1
        for dim in shape if isinstance(shape, list) else []:
            count *= _int(dim) or 0
        total += count * _ITEM_BYTES.get(str(dtype), 4)
    return total


def _op_name(entry: dict[str, Any]) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``."""
    return str(entry.get("profiling_name") or "?").rsplit(":", 1)[-1]
