"""Where a job's snapshots live: the directories, who may trust them, and what else is kept there.

Layout: ``<base>/nbtools-snapshots-<uid>/`` (mode 0700, owned by the user; base
is ``NBTOOLS_SNAPSHOT_DIR`` or ``/dev/shm``) holds one directory per job, named
from the job's key. In it, ``keeper`` records the process whose life bounds the
job's snapshots (the launching process of the ranks), beside the slot files
(see ``_slots``) and each rank's record of the volume. A job directory is made
whole: under a temporary name (``.new-...``) with its keeper record, then
renamed into place.

The predictable name of the user's directory is one another local user can take
first (a directory of theirs, a link). Such a directory is never trusted, and
never stops training either: the job's snapshots then go to a private directory,
``nbtools-snapshots-<uid>-<digest>``, whose name is a digest of the launch's run
id, which only the job's processes know (:func:`private_dir`).

**Ending jobs.** A manager that starts sweeps the job directories whose keeper
is dead, in this user's snapshot directory and in its private fallbacks; the
launcher drops a launch's directories when it ends for good (:func:`drop_jobs`).
The sweep removes a directory without a keeper record (one being dropped), but
leaves one still being made alone until it is a minute old (its maker was
killed before it recorded the keeper).

**What the ranks know of the volume.** A restore from memory must not pass over
a newer checkpoint on the volume. Listing the volume answers that, but it costs
round trips, and in a restarted process the start of the object store's client,
on the path of every restart. The ranks of the job know the answer already: the
newest step the volume held when the job last looked (every restore lists the
volume or learns the answer here), and the step of every volume save they
started since, which is written down before the save begins. So each rank keeps
one number, the *bound*: no checkpoint of this job on the volume is newer. It
lives in a small record in its node's job directory (``volume-r<rank>.json``,
private like the slots). A restore whose chosen snapshot is at least as new as
the bound of the records the ranks find needs no listing. Without any record (a
job that never restored, a job on new nodes), the volume is listed as before.
Only this job's saves add checkpoints under its root while it runs (the root's
writer lease keeps other machines out), so the bound holds for as long as the
job does.

**Room.** Each rank of a node keeps two slots of its own and two of each peer
whose replicas it holds; together they must fit in the snapshot filesystem (a
container's ``/dev/shm`` is often 64 MB) and in half of the node's available
memory, counting what this rank's slots already take (:func:`shortage`); on
``/dev/shm``, 64 MiB per rank stays free for NCCL's shared-memory transport. When
they do not, the tier turns itself off with one warning that says what it needs
and what to change, before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from typing import Any

from nbtools import runtime
from nbtools._internal import settings
from nbtools._internal.holder import Holder, Liveness
from nbtools.errors import CheckpointError

__all__ = [
    "KEEPER",
    "MEMORY_SHARE",
    "NCCL_SHM_RESERVE",
    "nccl_reserve",
    "NEW",
    "available_memory",
    "other_worlds",
    "drop_job_if_empty",
    "drop_jobs",
    "is_record",
    "job_dir",
    "job_path",
    "private_dir",
    "read_records",
    "remove_record",
    "shortage",
    "snapshot_base",
    "sweep",
    "sweep_all",
    "trusted",
    "user_dir",
    "user_dirs",
    "user_prefix",
    "write_record",
]

KEEPER = "keeper"
#: Tries of :func:`job_dir` and :func:`user_dir` before they give up.
_JOB_DIR_TRIES = 200


def snapshot_base() -> str:
    """Where the per-user snapshot directory is made: ``NBTOOLS_SNAPSHOT_DIR`` or /dev/shm."""
    return settings.read("NBTOOLS_SNAPSHOT_DIR") or "/dev/shm"


def _owned_private(path: str, what: str) -> None:
    """Raise unless ``path`` is a real directory of this user that nobody else can use."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(f"{what} {path} is not a directory (a link or a file); remove it")
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise CheckpointError(
            f"{what} {path} belongs to uid {info.st_uid} with mode {info.st_mode & 0o777:o}, "
            "not to this user with mode 700: snapshots there cannot be trusted; remove it"
        )


def trusted(path: str) -> bool:
    """Whether ``path`` is a real directory of this user that nobody else can use."""
    try:
        _owned_private(path, "")
    except (OSError, CheckpointError):
        return False
    return True


def user_prefix() -> str:
    """The name of this user's snapshot directory; its private fallbacks add a suffix."""
    return f"nbtools-snapshots-{os.geteuid()}"


def user_dir(base: str | None = None) -> str:
    """This user's snapshot directory under ``base``, made (0700) if absent and checked.

    Raises:
        CheckpointError: It exists but cannot be trusted (another user's, a link, open
            to others): see :func:`private_dir`.
    """
    path = os.path.join(base or snapshot_base(), user_prefix())
    _make_private(path, "the snapshot directory")
    return path


def _make_private(path: str, what: str) -> None:
    """Make the directory ``path`` (0700) unless it exists, and check it can be trusted."""
    for _ in range(_JOB_DIR_TRIES):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        try:
            _owned_private(path, what)
            return
        except FileNotFoundError:  # removed as empty by another job meanwhile
            continue
    raise CheckpointError(
        f"{what} {path} could not be made in {_JOB_DIR_TRIES} tries: other processes kept "
        "removing it meanwhile; set NBTOOLS_SNAPSHOT_DIR to a directory of this job's own"
    )


def private_dir(secret: str | None, base: str | None = None) -> str:
    """A directory of this user's under ``base`` whose name nobody else can predict, for
    when :func:`user_dir` cannot be trusted (another local user can plant that name).

    The name is a digest of ``secret``, which only the job's processes know (its
    launch's run id, in their environment), so that the ranks of a node and their
    restarts find the same directory; None: a random name (a process started by hand,
    which no restart looks for). It is made with ``mkdir`` (0700, failing if the name
    exists); one that already exists is used only if it can be trusted.

    Raises:
        CheckpointError: The name exists and cannot be trusted.
    """
    token = (
        hashlib.sha256(f"{os.geteuid()}|{secret}".encode()).hexdigest()[:32]
        if secret is not None
        else secrets.token_hex(16)
    )
    path = os.path.join(base or snapshot_base(), f"{user_prefix()}-{token}")
    _make_private(path, "the private snapshot directory")
    return path


def job_path(user: str, key: str) -> str:
    """Where the directory of the job ``key`` is under ``user``."""
    return os.path.join(user, f"job-{hashlib.sha256(key.encode()).hexdigest()[:32]}")


#: Prefix of a job directory being made (see :func:`job_dir`): the sweep leaves it alone.
NEW = ".new-"


def job_dir(user: str, key: str, keeper: Holder) -> str:
    """The directory of the job ``key``, made (0700, with its keeper record) if absent.

    A new directory appears whole: it is made under a temporary name, its keeper
    recorded, then renamed into place, so the sweep of another job never sees a job
    directory without its keeper (see :func:`sweep`).

    Raises:
        CheckpointError: The job's directory exists and cannot be trusted.
    """
    path = job_path(user, key)
    # Other jobs remove the user directory whenever it is left empty, and each removal
    # costs one more try here: enough tries that only a livelock could use them all.
    for _ in range(_JOB_DIR_TRIES):
        if os.path.lexists(path):
            _owned_private(path, "the job's snapshot directory")
            return path
        try:
            tmp = tempfile.mkdtemp(prefix=NEW, dir=user)
        except FileNotFoundError:  # the user directory was just removed as empty
            _make_private(user, "the snapshot directory")
            continue
        try:
            fd = os.open(os.path.join(tmp, KEEPER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({**keeper.record(), "key": key}, fh)
            os.rename(tmp, path)  # fails when another rank made it first (not empty)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.lexists(path):
                raise
            continue
        return path
    raise CheckpointError(
        f"the job's snapshot directory {path} could not be made in {_JOB_DIR_TRIES} tries: "
        f"other processes kept removing {user} or {path} meanwhile; set NBTOOLS_SNAPSHOT_DIR "
        "to a directory of this job's own"
    )


def drop_job_if_empty(directory: str) -> None:
    """Remove a job directory that holds no snapshot (its keeper and volume records go
    with it)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    if all(n == KEEPER or is_record(n) for n in names):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        with contextlib.suppress(OSError):
            os.rmdir(directory)
            os.rmdir(os.path.dirname(directory))  # the user's, when no other job is left


# --- ending jobs ---------------------------------------------------------------

#: Seconds after which a directory still being made, with no keeper, is a killed maker's.
STALE_NEW_S = 60.0


def _remove(path: str) -> bool:
    """Remove ``path`` (a directory and all it holds, or a file); whether it is gone.

    Tries again when the directory filled while it was removed (a dead job's rank that
    still ran for a moment).
    """
    for _ in range(5):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return True
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return not os.path.lexists(path)


def _keeper(path: str) -> tuple[Holder | None, str | None]:
    """The keeper recorded in the job directory ``path`` and the job's key (None: none)."""
    try:
        with open(os.path.join(path, KEEPER)) as fh:
            record = json.load(fh)
        key = record.get("key")
        return Holder.from_record(record), key if isinstance(key, str) else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None, None


def sweep(user: str, own: str | None = None) -> list[str]:
    """Remove the job directories under ``user`` whose keeper process is dead; their names.

    ``own`` (this job's directory) is never removed: a restarted rank's keeper may
    differ from the one recorded, and the job goes on.
    """
    removed: list[str] = []
    try:
        names = os.listdir(user)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(user, name)
        if path == own:
            continue
        keeper, _ = _keeper(path)
        if keeper is None and name.startswith(NEW):
            try:
                young = time.time() - os.lstat(path).st_mtime < STALE_NEW_S
            except FileNotFoundError:  # renamed into place meanwhile
                continue
            if young:
                continue
        if keeper is None or keeper.alive() is Liveness.DEAD:
            _remove(path)
            removed.append(name)
    return removed


def user_dirs(base: str | None = None) -> list[str]:
    """This user's trusted snapshot directories under ``base``: the usual one and any
    private fallback (see :func:`private_dir`)."""
    base = base or snapshot_base()
    prefix = user_prefix()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = [n for n in names if n == prefix or n.startswith(f"{prefix}-")]
    return [os.path.join(base, n) for n in sorted(found) if trusted(os.path.join(base, n))]


def _drop_if_empty(user: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(user)


def sweep_all(base: str | None = None, own: str | None = None) -> list[str]:
    """:func:`sweep` every trusted snapshot directory of this user under ``base``; a
    fallback left empty goes too. The job directories removed."""
    removed = []
    for user in user_dirs(base):
        removed += sweep(user, own)
        if own is None or os.path.dirname(own) != user:
            _drop_if_empty(user)
    return removed


def drop_jobs(prefix: str, base: str | None = None) -> list[str]:
    """Remove every job directory of this user under ``base`` (default: the snapshot base)
    whose key starts with ``prefix``, in every snapshot directory of this user there; their
    names.

    The launcher's hook for a launch that ended for good (``"run:<run id>|"``):
    its snapshots serve no restart any more.
    """
    removed = []
    for user in user_dirs(base):
        with contextlib.suppress(OSError):
            for name in os.listdir(user):
                path = os.path.join(user, name)
                _, key = _keeper(path)
                if key is not None and key.startswith(prefix) and _remove(path):
                    removed.append(name)
        _drop_if_empty(user)  # when no job is left
    return removed


def other_worlds(user: str, key: str) -> list[int]:
    """The world sizes other than ``key``'s of this job's directories under ``user`` that
    hold a slot: the same run and root, snapshotted by another number of ranks (an
    elastic job that grew or shrank)."""
    stem, sep, world = key.rpartition("|world=")
    if not sep:
        return []
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(user):
            path = os.path.join(user, name)
            _, other = _keeper(path)
            if other is None or other == key or not other.startswith(stem + sep):
                continue
            size = other[len(stem + sep) :]
            with contextlib.suppress(OSError):
                if size.isdigit() and any(n.endswith(".slot") for n in os.listdir(path)):
                    found.add(int(size))
    return sorted(found)


# --- what the ranks know of the volume ------------------------------------------

_RECORD_PREFIX = "volume-r"
#: A record is a few dozen bytes; anything larger was not written here.
_MAX_BYTES = 4096


def _record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{_RECORD_PREFIX}{rank}.json")


def is_record(name: str) -> bool:
    """Whether a file name in a job directory is a volume record (or one half-written)."""
    return name.startswith(_RECORD_PREFIX)


def write_record(directory: str, key: str, rank: int, bound: int | None) -> None:
    """Record ``bound`` for ``rank`` (atomically: the old record or the new one)."""
    path = _record_path(directory, rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "rank": rank, "bound": bound}, fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _load_record(path: str) -> dict[str, Any] | None:
    """A record file's content when this user wrote it and nobody else can; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as fh:
        info = os.fstat(fh.fileno())
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_mode & 0o077
            or info.st_size > _MAX_BYTES
        ):
            return None
        try:
            data = json.load(fh)
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


def read_records(directory: str, key: str) -> tuple[bool, int | None]:
    """``(known, bound)`` from the trusted records of the job ``key`` in ``directory``:
    ``known`` is False when there is none; ``bound`` is the newest step any names
    (None: the volume held no checkpoint of the job)."""
    known, bound = False, None
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return known, bound
    for name in names:
        if not (is_record(name) and name.endswith(".json")):
            continue
        data = _load_record(os.path.join(directory, name))
        if data is None or data.get("key") != key:
            continue
        value = data.get("bound")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            continue
        known = True
        if value is not None:
            bound = value if bound is None else max(bound, value)
    return known, bound


def remove_record(directory: str, rank: int) -> None:
    """Drop ``rank``'s record (absent is fine)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_record_path(directory, rank))


# --- room ----------------------------------------------------------------------

#: Fraction of the node's available memory the snapshots of its ranks may take.
MEMORY_SHARE = 0.5
#: ``/dev/shm`` left free per rank of the node for NCCL's shared-memory transport and
#: proxy segments, which NCCL creates lazily, mid-run (4 MiB buffers per channel and peer).
NCCL_SHM_RESERVE = 64 << 20


def nccl_reserve(directory: str, ranks: int) -> int:
    """Bytes of ``directory``'s filesystem kept free for NCCL: ``NCCL_SHM_RESERVE`` per
    rank of the node when it is ``/dev/shm`` (where NCCL puts its segments), else 0."""
    try:
        same = os.stat(directory).st_dev == os.stat("/dev/shm").st_dev
    except OSError:
        return 0
    return NCCL_SHM_RESERVE * ranks if same else 0


def available_memory() -> int | None:
    """The node's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def shortage(directory: str, user: str, size: int, peers: int, held: int) -> str | None:
    """Why the snapshots of this node's ranks do not fit, or None when they do.

    Args:
        directory: The job's snapshot directory (its filesystem is checked).
        user: The user's snapshot directory, named in the message.
        size: One slot's bytes (header, tensors, skeleton).
        peers: Peers whose replicas this rank holds (two slots each).
        held: Bytes this rank's slots and replicas already take there.
    """
    ranks = max(1, runtime.get_local_world_size())
    copies = 2 * (1 + peers)
    need = copies * ranks * size
    reserve = nccl_reserve(directory, ranks)
    free = shutil.disk_usage(directory).free - reserve
    memory = available_memory()
    if need <= free + held and (memory is None or need <= MEMORY_SHARE * memory + held):
        return None
    return (
        f"{copies} snapshots for each of the {ranks} rank(s) of this node (its own two"
        + (f" and two of each of the {peers} peer(s) it holds" if peers else "")
        + f") need about {need / 2**20:.1f} MiB ({size / 2**20:.1f} MiB each) in "
        f"{user}, but that filesystem has {free / 2**20:.1f} MiB free"
        + (f" beside {reserve / 2**20:.0f} MiB kept for NCCL" if reserve else "")
        + (f" and the node {memory / 2**20:.1f} MiB of memory available" if memory else "")
        + ". Give the shared-memory mount more room (docker run --shm-size=...), point "
        "NBTOOLS_SNAPSHOT_DIR at a larger tmpfs, keep fewer replicas, or snapshot less state"
    )
