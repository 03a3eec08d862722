"""Nodes that start at once list a dataset root once: the listing lease beside the shared index.

Each "node" is a process of its own with a private cache of its own, as on
separate machines that mount one volume; they meet only in the root.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from nbtools._internal.fs import TMP_PREFIX
from nbtools.data._listing import _lease as _rootlease
from nbtools.data._listing._catalog import load_index
from nbtools.data._listing._lease import ListingLease
from nbtools.data._listing._shared_index import publish_shared, shared_path

_PATTERN = "**/*"


def _backdate(root) -> None:
    past = time.time() - 3600
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (past, past))


def _node(src: str, cache: str, token: str, start, out) -> None:
    start.wait()
    index = load_index(src, _PATTERN, cache, False, token, in_root=True)
    out.put((len(index), index.header["listed_by"]))


def _run_nodes(src, caches, token: str, before_start=None) -> list[tuple[int, str]]:
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_node, args=(str(src), str(c), token, start, out)) for c in caches]
    for proc in procs:
        proc.start()
    try:
        start.set()
        if before_start is not None:
            before_start()
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        out.close()
        out.join_thread()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return results


def _index_dir_names(src) -> list[str]:
    return sorted(os.listdir(os.path.dirname(shared_path(str(src), _PATTERN))))


def test_nodes_starting_at_once_list_the_root_once(tree, tmp_path):
    src, _ = tree
    _backdate(src)
    results = _run_nodes(src, [tmp_path / f"node-{i}" for i in range(4)], "job-1")
    assert {n for n, _ in results} == {40}
    listers = {who for _, who in results}
    assert len(listers) == 1, f"the root was listed by {sorted(listers)}"
    assert not listers & {f"{socket.gethostname()} pid {os.getpid()}"}
    # The lease is gone, and so is every temporary: only the index is left.
    assert _index_dir_names(src) == [os.path.basename(shared_path(str(src), _PATTERN))]


def test_nodes_wait_while_another_holds_the_lease_and_use_the_index_it_publishes(tree, tmp_path):
    src, _ = tree
    _backdate(src)
    shared = shared_path(str(src), _PATTERN)
    os.makedirs(os.path.dirname(shared))
    lease = ListingLease(shared, "job-1")
    assert lease.take()

    def list_here_then_release() -> None:
        time.sleep(1.0)  # the nodes are waiting by now; the outcome does not depend on it
        mine = load_index(str(src), _PATTERN, str(tmp_path / "lister"), False, "job-1")
        publish_shared(mine.path, shared)
        lease.release()

    try:
        results = _run_nodes(
            src,
            [tmp_path / "node-a", tmp_path / "node-b"],
            "job-1",
            before_start=list_here_then_release,
        )
    finally:
        lease.release()
    assert results == [(40, f"{socket.gethostname()} pid {os.getpid()}")] * 2


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _leave_lease(src, host: str, pid: int) -> str:
    shared = shared_path(str(src), _PATTERN)
    os.makedirs(os.path.dirname(shared), exist_ok=True)
    with open(shared + ".listing", "w") as fh:
        fh.write(f'{{"host": "{host}", "pid": {pid}, "job": "old", "since": 0}}')
    return shared + ".listing"


def test_a_lease_left_by_a_dead_process_is_taken_over_at_once(tree, caplog):
    src, cache = tree
    _backdate(src)
    caplog.set_level("INFO", logger="nbtools")
    lease = _leave_lease(src, socket.gethostname(), _dead_pid())
    # What the dead node was writing when it died: swept by the node that takes over.
    partial = os.path.join(os.path.dirname(lease), f"{TMP_PREFIX}999-dead.idx")
    with open(partial, "wb") as fh:
        fh.write(b"NBTIDX01 half")
    os.utime(partial, (time.time() - 7200, time.time() - 7200))
    index = load_index(str(src), _PATTERN, str(cache), False, "job-2", in_root=True)
    assert len(index) == 40
    assert index.header["listed_by"] == f"{socket.gethostname()} pid {os.getpid()}"
    assert "listed " in caplog.text and "and died" in caplog.text
    assert not os.path.exists(lease)
    assert not os.path.exists(partial)


def test_a_lease_nobody_refreshes_is_taken_over_after_a_while(tree, caplog, monkeypatch):
    src, cache = tree
    _backdate(src)
    caplog.set_level("INFO", logger="nbtools")
    monkeypatch.setattr(_rootlease, "STALE_S", 0.5)
    lease = _leave_lease(src, "another-node", 12345)  # a live-looking lease of another host
    index = load_index(str(src), _PATTERN, str(cache), False, "job-3", in_root=True)
    assert len(index) == 40
    assert "stopped refreshing its lease" in caplog.text
    assert not os.path.exists(lease)


def test_a_failed_listing_leaves_no_lease(tree):
    src, cache = tree
    with pytest.raises(FileNotFoundError, match="no file under"):
        load_index(str(src), "**/*.nothing", str(cache), False, "job-4", in_root=True)
    assert not os.path.exists(shared_path(str(src), "**/*.nothing") + ".listing")


def test_waiting_nodes_say_how_far_the_listing_node_got(tree, tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    src, _ = tree
    caplog.set_level("INFO", logger="nbtools")
    monkeypatch.setattr(_rootlease, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(_rootlease, "_SAY_EVERY_S", 0.0)
    shared = shared_path(str(src), _PATTERN)
    os.makedirs(os.path.dirname(shared))
    counts = SimpleNamespace(files=0, dirs=0)
    lister = ListingLease(shared, "job-5", counts)
    assert lister.take()
    try:
        counts.files, counts.dirs = 123_456, 789  # as the listing goes on
        deadline = time.monotonic() + 30
        while (lister.holder() or {}).get("files") != 123_456:
            assert time.monotonic() < deadline, "the lease never showed the listing's progress"
            time.sleep(0.02)
        looks = iter([None, None, "the index"])
        lease, found = _rootlease.lead_or_wait(
            shared, "job-5", str(src), lambda: next(looks), poll_s=0.01
        )
        assert (lease, found) == (None, "the index")
        assert "123456 files in 789 directories so far" in caplog.text
    finally:
        lister.release()
    assert not os.path.exists(shared + ".listing")
    assert [n for n in os.listdir(os.path.dirname(shared)) if n.startswith(TMP_PREFIX)] == []


def _plant(src, kind: str) -> str:
    shared = shared_path(str(src), _PATTERN)
    os.makedirs(os.path.dirname(shared), exist_ok=True)
    lease = shared + ".listing"
    if kind == "dangling link":
        os.symlink("/nonexistent/nbtools-lease", lease)
    elif kind == "fifo":
        os.mkfifo(lease)
    elif kind == "writable by others":
        with open(lease, "w") as fh:
            fh.write('{"host": "another-node", "pid": 1, "job": "x", "since": 0}')
        os.chmod(lease, 0o666)
    elif kind == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        with open(lease, "w") as fh:
            fh.write('{"host": "another-node", "pid": 1, "job": "x", "since": 0}')
        os.chown(lease, 4321, 4321)
    return lease


@pytest.mark.parametrize("kind", ["dangling link", "fifo", "writable by others", "another user's"])
def test_a_planted_lease_is_not_waited_on(tree, caplog, kind):
    src, cache = tree
    _backdate(src)
    caplog.set_level("INFO", logger="nbtools")
    lease = _plant(src, kind)
    index = load_index(str(src), _PATTERN, str(cache), False, "job-6", in_root=True)
    assert len(index) == 40
    assert "not waiting on the listing lease" in caplog.text
    assert os.path.lexists(lease)  # somebody else's: left where it is
    os.unlink(lease)


def test_a_lease_whose_pid_now_belongs_to_another_process_is_dead():
    # The holder's pid was reused: it runs, but started long after the lease was written.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = _rootlease.lease_record()
        reused = {
            "host": socket.gethostname(),
            **ours,
            "pid": sleeper.pid,
            "started": ours["started"] - 3600,
            "job": "old",
            "since": time.time(),
        }
        assert _rootlease._dead(reused)
        same = dict(reused, started=_proc_started(sleeper.pid))
        assert not _rootlease._dead(same)
        # A lease of an older version (host and pid only) is judged by the pid alone.
        assert not _rootlease._dead({"host": socket.gethostname(), "pid": sleeper.pid})
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _rootlease._dead({"host": socket.gethostname(), "pid": sleeper.pid})


def _proc_started(pid: int) -> float | None:
    from nbtools._internal.holder import process_started

    return process_started(pid)
