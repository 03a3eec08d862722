"""What makes a writer lease live, and that judging one never blocks the training loop."""

from __future__ import annotations

import json
import os
import threading
import time

import psutil
import pytest
from ckpt_training import Net

from nbtools._internal.holder import machine_id as _machine
from nbtools.checkpoint import CheckpointManager, _lease
from nbtools.checkpoint._lease import LEASE_NAME
from nbtools.errors import CheckpointError

MONTH_S = 30 * 24 * 3600.0


def _plant(root, **record) -> None:
    root.mkdir(parents=True, exist_ok=True)
    # Written beside the root and renamed in, as a lease holder would: never seen half-written.
    part = root.parent / f".{LEASE_NAME}.{threading.get_ident()}"
    part.write_text(json.dumps({"token": "someone-else", **record}))
    os.replace(part, root / LEASE_NAME)


def _holder(root) -> dict:
    return json.loads((root / LEASE_NAME).read_text())


def _other_machine(**extra) -> dict:
    """A lease another machine wrote 40 s ago: neither fresh nor old enough to drop unseen."""
    now = time.time()
    return dict(
        pid=4321,
        machine="node-7/boot/ns",
        host="node-7",
        since=now - 40,
        time=now - 40,
        beat=3,
        **extra,
    )


@pytest.mark.parametrize("started", ["missing", "pid 1's own"])
def test_a_month_old_lease_naming_pid_1_is_taken_over_at_once(tmp_path, started):
    root = tmp_path / "root"
    record = dict(
        pid=1,
        machine=_machine(),
        host="here",
        since=time.time() - MONTH_S,
        time=time.time() - MONTH_S,
        beat=7,
    )
    if started != "missing":  # the right start time, but no heartbeat for a month
        record["started"] = psutil.Process(1).create_time()
    _plant(root, **record)
    with CheckpointManager(root, async_save=False) as ckpt:
        assert ckpt.save(1, model=Net())
        assert _holder(root)["pid"] == os.getpid()
    assert sorted(os.listdir(root)) == ["step_1"]


def test_a_lease_of_another_machine_never_blocks_the_first_save(tmp_path, monkeypatch):
    # Watching for an hour: a save that waited for the verdict would not return.
    monkeypatch.setattr(_lease, "WATCH_S", 3600.0)
    root = tmp_path / "root"
    _plant(root, **_other_machine())
    ckpt = CheckpointManager(root, every=1)
    outcome: list = []
    saver = threading.Thread(target=lambda: outcome.append(ckpt.maybe_save(0, model=Net())))
    saver.start()
    saver.join(120)
    try:
        assert not saver.is_alive(), "the save waited for the lease's verdict"
        assert outcome == [False]  # deferred, not refused and not written
        assert sorted(os.listdir(root)) == [LEASE_NAME]
        assert _holder(root)["host"] == "node-7"
    finally:
        ckpt.close(final_save=False)
    # Known to be gone: taken over at once, without waiting for the watch.
    with CheckpointManager(root, every=1, takeover=True) as ckpt:
        assert ckpt.maybe_save(0, model=Net())
        ckpt.wait()
        assert _holder(root)["pid"] == os.getpid()
    assert sorted(os.listdir(root)) == ["step_0"]


def test_a_deferred_save_is_made_at_the_first_step_after_the_lease_is_found_abandoned(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(_lease, "WATCH_S", 0.5)
    monkeypatch.setattr(_lease, "_POLL_S", 0.05)
    root = tmp_path / "root"
    _plant(root, **_other_machine())
    net = Net()
    ckpt = CheckpointManager(root, every=100, async_save=False)
    try:
        assert not ckpt.maybe_save(0, model=net)  # due, deferred
        saved = None
        for step in range(1, 100_000):
            if ckpt.maybe_save(step, model=net):
                saved = step
                break
            time.sleep(0.01)
        assert saved is not None and saved % 100 != 0  # not left for the next due step
        assert _holder(root)["pid"] == os.getpid()
        assert not ckpt.maybe_save(saved + 1, model=net)  # back to every=100
    finally:
        ckpt.close(final_save=False)
    assert sorted(os.listdir(root)) == [f"step_{saved}"]


def test_another_machine_renewing_its_lease_is_refused_saying_how_to_take_over(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(_lease, "WATCH_S", 1.0)
    monkeypatch.setattr(_lease, "_POLL_S", 0.05)
    root = tmp_path / "root"
    record = _other_machine()
    _plant(root, **record)
    stop = threading.Event()

    def renew() -> None:  # the other machine's heartbeat
        beat = record["beat"]
        while not stop.wait(0.1):
            beat += 1
            _plant(root, **{**record, "beat": beat})

    heart = threading.Thread(target=renew)
    heart.start()
    try:
        ckpt = CheckpointManager(root, every=1, async_save=False)
        try:
            with pytest.raises(CheckpointError) as refused:
                for step in range(100_000):
                    assert not ckpt.maybe_save(step, model=Net())
                    time.sleep(0.01)
            assert "pid 4321 on host node-7" in str(refused.value)
            assert "takeover=True" in str(refused.value)
            assert f"delete {root / LEASE_NAME}" in str(refused.value)
            with pytest.raises(CheckpointError, match="pid 4321 on host node-7"):
                ckpt.maybe_save(step + 1, model=Net())  # still held: refused again
        finally:
            ckpt.close(final_save=False)
        assert sorted(os.listdir(root)) == [LEASE_NAME]
        stop.set()  # the other machine stops renewing; a takeover would stop it on a real one
        heart.join()
        with CheckpointManager(root, async_save=False, takeover=True) as ckpt:
            assert ckpt.save(1, model=Net())
    finally:
        stop.set()
        heart.join()
    assert sorted(os.listdir(root)) == ["step_1"]


def test_a_lease_of_this_machine_not_renewed_for_minutes_is_taken_over(tmp_path):
    # The holder's process is alive and its start time matches, but it stopped renewing.
    root = tmp_path / "root"
    me = psutil.Process(os.getppid())
    _plant(
        root,
        pid=me.pid,
        started=me.create_time(),
        machine=_machine(),
        host="here",
        since=time.time() - 600,
        time=time.time() - 600,
        beat=2,
    )
    with CheckpointManager(root, async_save=False) as ckpt:
        assert ckpt.save(1, model=Net())
    assert sorted(os.listdir(root)) == ["step_1"]
