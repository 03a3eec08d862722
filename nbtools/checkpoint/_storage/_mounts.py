"""The mount type of a local path, to tell network and FUSE mounts from local disks.

The mount table is read through ``psutil.disk_partitions`` once per filesystem
(device id) seen, not on every save.
"""

from __future__ import annotations

import os

__all__ = ["is_remote_fs"]

# Filesystems where reading in place is slow or remote: reads are staged locally.
_REMOTE_FSTYPES = ("nfs", "cifs", "smb", "fuse", "9p", "ceph", "lustre", "gpfs", "glusterfs", "afs")

# Mount type by device id: the mount table is read once per filesystem seen, not per
# save; a filesystem mounted later has a new device id and is looked up then.
_FSTYPE_BY_DEV: dict[int, str] = {}


def _lookup_fstype(path: str) -> str:
    import psutil

    best, fstype = "", ""
    try:
        partitions = psutil.disk_partitions(all=True)
    except (OSError, RuntimeError):
        return ""
    for part in partitions:
        mount = part.mountpoint
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, part.fstype
    return fstype


def _fstype(path: str) -> str:
    """The mount type of the filesystem holding ``path`` or its nearest existing ancestor."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    probe = os.path.realpath(probe or "/")
    try:
        dev = os.stat(probe).st_dev
    except OSError:
        return ""
    if dev not in _FSTYPE_BY_DEV:
        _FSTYPE_BY_DEV[dev] = _lookup_fstype(probe)
    return _FSTYPE_BY_DEV[dev]


def is_remote_fs(path: str) -> bool:
    """Whether ``path`` (or where it would be created) is on a network or FUSE mount."""
    return any(_fstype(path).startswith(t) for t in _REMOTE_FSTYPES)
