"""The memory tier leaves part of ``/dev/shm`` to NCCL's shared-memory transport."""

from __future__ import annotations

import os
import shutil

import pytest

from nbtools.checkpoint._memory import _directories


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_snapshots_on_dev_shm_leave_nccl_its_reserve(tmp_path):
    assert _directories.nccl_reserve("/dev/shm", 8) == 8 * _directories.NCCL_SHM_RESERVE
    assert _directories.nccl_reserve(str(tmp_path), 8) == 0  # not where NCCL puts segments
    # Two slots that would fill all but half the reserve of /dev/shm do not fit.
    free = shutil.disk_usage("/dev/shm").free
    size = (free - _directories.NCCL_SHM_RESERVE // 2) // 2
    why = _directories.shortage("/dev/shm", "/dev/shm", size, peers=0, held=0)
    assert why is not None and "64 MiB kept for NCCL" in why
