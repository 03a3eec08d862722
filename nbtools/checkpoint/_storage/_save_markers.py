"""Saves in progress in one checkpoint directory: their markers, and what no checkpoint uses.

A collective save keeps a marker ``.nbtools-saving-<tag>`` in its directory
from before it writes anything until after it has published ``.metadata`` and
removed what the checkpoint it replaced used. The marker says who writes
(process, start time, machine), so the next save there can tell:

- ``live``: a save of a live process of this machine (or a save of this
  process still running on another thread). Two saves at once are refused.
- ``unknown``: a save of another machine that started less than
  :data:`MARK_MAX_AGE_S` ago. Nothing tells whether it still runs, so its files
  are left alone and this save names its own files apart (no file is shared).
- ``stale``: the process is gone (SIGKILL, a crash) or the marker is older than
  :data:`MARK_MAX_AGE_S`. What it wrote and no checkpoint names is removed.

Invariant: a file named by the directory's current ``.metadata`` is never
removed, whatever the markers say. A sweep lists the directory first and reads
the current metadata after the listing: a save removes its marker only after
publishing, so a file whose writer had no marker in the listing is either
named by the metadata read afterwards or never will be.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nbtools._internal.fs import TMP_PREFIX
from nbtools._internal.holder import Holder, Liveness, machine_id
from nbtools._internal.lease import lease_record
from nbtools._internal.log import get_logger
from nbtools.checkpoint._storage._layout import (
    METADATA_NAME,
    RANK_METADATA_RE,
    is_shard,
    save_mark_name,
    save_mark_tag,
)
from nbtools.checkpoint._storage._safe_pickle import read_metadata
from nbtools.checkpoint._storage._target import Target
from nbtools.errors import CheckpointError

__all__ = [
    "MARK_MAX_AGE_S",
    "Survey",
    "begin",
    "end",
    "survey",
    "refuse_live",
    "metadata_files",
    "sweep",
]

_log = get_logger("checkpoint")

#: A marker of another machine older than this (by its own clock) was left by a dead save.
MARK_MAX_AGE_S = 3600.0

# Tags of the saves of this process between their marker and its removal, with the
# thread that runs each: a save whose thread is this one, or has ended, is not running.
_in_flight: dict[str, int] = {}
_in_flight_lock = threading.Lock()
_warned: set[str] = set()


def begin(target: Target, tag: str) -> None:
    """Publish the marker of the save ``tag`` (before it writes anything) and note it here."""
    record = lease_record(time=time.time())
    with _in_flight_lock:
        _in_flight[tag] = threading.get_ident()
    target.publish_bytes(save_mark_name(tag), json.dumps(record).encode())


def end(target: Target, tag: str) -> None:
    """Remove the marker of the save ``tag`` (best effort: a leftover marker is stale later)."""
    with _in_flight_lock:
        _in_flight.pop(tag, None)
    try:
        target.remove_file(save_mark_name(tag))
    except OSError as exc:
        _log.warning("could not remove %s/%s: %s", target.url, save_mark_name(tag), exc)


def _running_here(tag: str) -> bool:
    with _in_flight_lock:
        ident = _in_flight.get(tag)
    if ident is None or ident == threading.get_ident():
        return False  # one thread runs one save at a time: an earlier one of this thread failed
    return any(t.ident == ident and t.is_alive() for t in threading.enumerate())


def _state(tag: str, record: Any) -> str:
    if not isinstance(record, dict):
        return "stale"  # not a marker nbtools wrote
    if record.get("machine") == machine_id():
        pid = record.get("pid")
        if pid == os.getpid():
            return "live" if _running_here(tag) else "stale"
        holder = Holder.from_record(record)  # without a start time: judged by its pid
        return "live" if holder is not None and holder.alive() is Liveness.ALIVE else "stale"
    try:
        age = time.time() - float(record.get("time", 0))
    except (TypeError, ValueError):
        return "stale"
    return "stale" if age > MARK_MAX_AGE_S else "unknown"


@dataclass
class Survey:
    """One listing of a checkpoint directory, sorted by what each name is."""

    names: list[str]
    shards: list[str] = field(default_factory=list)
    temporary: list[str] = field(default_factory=list)
    rank_local: list[str] = field(default_factory=list)
    live: dict[str, dict[str, Any]] = field(default_factory=dict)
    unknown: dict[str, dict[str, Any]] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)

    @property
    def has_metadata(self) -> bool:
        """Whether the listing held ``.metadata``."""
        return METADATA_NAME in self.names

    @property
    def others_writing(self) -> bool:
        """Whether another save may be writing here (live or unknown)."""
        return bool(self.live or self.unknown)


def survey(target: Target, own_tag: str | None = None) -> Survey:
    """List ``target`` and tell every other save's marker apart (live, unknown, stale)."""
    names = target.listdir()
    found = Survey(names=names)
    for name in names:
        tag = save_mark_tag(name)
        if tag is not None:
            if tag == own_tag:
                continue
            try:
                record = json.loads(target.read_bytes(name))
            except FileNotFoundError:
                continue  # that save just finished
            except (OSError, ValueError):
                record = None
            state = _state(tag, record)
            if state == "stale":
                found.stale.append(name)
            else:
                (found.live if state == "live" else found.unknown)[name] = record
        elif is_shard(name):
            found.shards.append(name)
        elif name.startswith(TMP_PREFIX):
            found.temporary.append(name)
        elif RANK_METADATA_RE.match(name):
            found.rank_local.append(name)
    return found


def _describe(record: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("time", 0))))
    return f"pid {record.get('pid')} on host {record.get('host')}, since {when}"


def refuse_live(found: Survey, where: str) -> None:
    """Raise when another save writes into this directory now; say so once for unknown ones."""
    if found.live:
        record = next(iter(found.live.values()))
        raise CheckpointError(
            f"another save is writing into {where} now ({_describe(record)}); two saves into "
            "one checkpoint directory at the same time would race, so this one writes nothing. "
            "Wait for the other save to finish (dcp.async_save: call .result() on its future "
            "first), or save to another directory"
        )
    for name, record in found.unknown.items():
        key = f"{where}/{name}"
        if key not in _warned:
            _warned.add(key)
            _log.warning(
                "%s: a save of another machine (%s) has not finished; its files are left "
                "alone and this save's files are named apart (a marker older than %.0f min "
                "counts as left by a dead save)",
                where,
                _describe(record),
                MARK_MAX_AGE_S / 60,
            )


def metadata_files(target: Target) -> set[str] | None:
    """The shard files the current ``.metadata`` names (none when absent); None when unreadable."""
    if not target.exists(METADATA_NAME):
        return set()
    try:
        metadata = read_metadata(target, target.url)
    except FileNotFoundError:
        return set()
    except Exception:  # noqa: BLE001 - torn or foreign metadata: no file counts as unused
        return None
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


def sweep(target: Target, found: Survey, keep: set[str]) -> int:
    """Remove shards not in ``keep``, temporary files and stale markers of a listing.

    Only for a listing without other saves writing (see the module docstring).
    Returns how many files were removed.
    """
    doomed = [n for n in found.shards if n not in keep] + found.temporary + found.stale
    removed = 0
    for name in doomed:
        try:
            target.remove_file(name)
            removed += 1
        except OSError as exc:  # left for the next save to try again
            _log.warning("could not remove %s/%s: %s", target.url, name, exc)
    return removed
