"""One conformance suite for the two leases nbtools holds: a checkpoint root's writer lease
(``checkpoint._lease.WriterLease``) and a dataset root's listing lease
(``data._listing._lease.ListingLease``).

Both promise the same things, whatever their file formats and timings: one live holder at a
time; a release hands the lease on at once; a holder that died (killed, or whose pid now
names another process) is taken over at once; a live holder keeps renewing it. Each case runs
against both, with the holder a real process of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbtools._internal.lease import lease_record

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Kind:
    """How one lease is taken, released and found, in this process and in a holder's."""

    name: str
    make: str  # code that makes the lease object ``lease`` for the root ROOT
    take: str  # a statement that takes it, raising if it cannot
    file: str  # the lease file, relative to ROOT
    fields: tuple[tuple[str, object], ...]  # what the implementation writes besides the holder

    def lease(self, root: Path):
        scope: dict = {"ROOT": str(root)}
        exec(self.make, scope)
        return scope["lease"]

    def try_take(self, lease) -> bool:
        if self.name == "writer":
            from nbtools.errors import CheckpointError

            try:
                lease.acquire()
            except CheckpointError:  # refused, or pending (a subclass)
                return False
            return True
        # A node that finds the lease taken looks at it once (as ``lead_or_wait`` does at each
        # poll) and takes it if its holder is gone.
        from nbtools._internal.lease import LeaseWatch
        from nbtools.data._listing._lease import ABANDONED_S, STALE_S

        watch = LeaseWatch(quiet_s=STALE_S, max_age_s=ABANDONED_S)
        return lease.take() or (lease.judge(watch, "the root") and lease.take())


KINDS = [
    Kind(
        "writer",
        "from nbtools.checkpoint._lease import WriterLease\n"
        "from nbtools.checkpoint._storage import open_target\n"
        "lease = WriterLease(open_target(ROOT))\n",
        "lease.acquire()\n",
        ".nbtools-writer",
        (("token", "a-token"), ("beat", 1)),
    ),
    Kind(
        "listing",
        "from nbtools.data._listing._lease import ListingLease\n"
        "lease = ListingLease(ROOT + '/index.idx', 'a-job')\n",
        "assert lease.take()\n",
        "index.idx.listing",
        (("job", "a-job"),),
    ),
]


def _holder(kind: Kind, root: Path, heartbeat_s: float | None = None) -> subprocess.Popen:
    """A process that takes the lease, says so, and releases it when told (or dies)."""
    beat = ""
    if heartbeat_s is not None:
        module = (
            "nbtools.checkpoint._lease" if kind.name == "writer" else "nbtools.data._listing._lease"
        )
        beat = f"import {module} as m\nm.HEARTBEAT_S = {heartbeat_s}\n"
    code = (
        f"ROOT = {str(root)!r}\n{beat}{kind.make}{kind.take}"
        "print('held', flush=True)\n"
        "import sys\n"
        "if sys.stdin.readline().strip() == 'release':\n"
        "    lease.release()\n"
        "    print('released', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if line != "held":
        proc.kill()
        proc.wait(30)
        pytest.fail(f"the {kind.name} lease's holder did not take it (said {line!r})")
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


@pytest.fixture(params=KINDS, ids=lambda k: k.name)
def kind(request):
    return request.param


def test_one_live_holder_at_a_time_and_a_release_hands_it_on_at_once(kind, tmp_path):
    holder = _holder(kind, tmp_path)
    try:
        contender = kind.lease(tmp_path)
        assert not kind.try_take(contender)
        assert (tmp_path / kind.file).exists()
        holder.stdin.write("release\n")  # type: ignore[union-attr]
        holder.stdin.flush()  # type: ignore[union-attr]
        assert holder.stdout.readline().strip() == "released"  # type: ignore[union-attr]
        assert holder.wait(60) == 0
        assert kind.try_take(contender)
        contender.release()
        assert not (tmp_path / kind.file).exists()
    finally:
        _end(holder)


def test_a_killed_holder_is_taken_over_at_once(kind, tmp_path):
    holder = _holder(kind, tmp_path)
    try:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        contender = kind.lease(tmp_path)
        assert kind.try_take(contender)
        record = json.loads((tmp_path / kind.file).read_text())
        assert record["pid"] == os.getpid()
        contender.release()
    finally:
        _end(holder)


def test_a_holder_whose_pid_now_names_another_process_is_taken_over(kind, tmp_path):
    # The record names a live process of this machine, but not the one that wrote it: its
    # start time differs. A reused pid holds nothing.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record = lease_record(since=time.time(), time=time.time(), **dict(kind.fields))
        record.update(pid=other.pid, started=12345)
        (tmp_path / kind.file).write_text(json.dumps(record))
        os.chmod(tmp_path / kind.file, 0o644)
        contender = kind.lease(tmp_path)
        assert kind.try_take(contender)
        assert json.loads((tmp_path / kind.file).read_text())["pid"] == os.getpid()
        contender.release()
    finally:
        other.kill()
        other.wait(30)


def test_a_live_holder_keeps_renewing_its_lease(kind, tmp_path):
    holder = _holder(kind, tmp_path, heartbeat_s=0.2)
    try:
        path = tmp_path / kind.file
        first = (path.read_bytes(), path.stat().st_mtime_ns)
        deadline = time.monotonic() + 60
        while (path.read_bytes(), path.stat().st_mtime_ns) == first:
            assert time.monotonic() < deadline, f"the {kind.name} lease was not renewed in 60 s"
            time.sleep(0.1)
        assert json.loads(path.read_bytes())["pid"] == holder.pid
        assert not kind.try_take(kind.lease(tmp_path))
    finally:
        _end(holder)
