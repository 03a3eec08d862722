"""The memory tier: snapshots in node-local shared memory that a restart restores from."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from ckpt_training import two_rank_reference

from nbtools import events
from nbtools.checkpoint import CheckpointManager

# A training run defined in __main__ (as in a notebook cell): every step draws from the
# global RNG, so a resume that lost the RNG streams or a step shows in the draws.
_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from nbtools.checkpoint import CheckpointManager

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x)

    root, memory_every, kill_at, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    ckpt = CheckpointManager(root, every=20, memory_every=None if memory_every == "-" else int(memory_every))
    start = ckpt.restore(model=net, optimizer=opt)
    draws = {}
    for step in range(start, steps):
        x = torch.randn(4, 8)
        draws[step] = float(x.sum())
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
        ckpt.maybe_save(step, model=net, optimizer=opt)
        if step == kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    print(json.dumps({"start": start, "tier": ckpt.restored_tier, "draws": draws,
                      "weights": [float(p.double().sum()) for p in net.parameters()]}))
    """
)


def _run(tmp_path, root, memory_every, kill_at, steps=30, run_id="job-1"):
    script = tmp_path / "train.py"
    script.write_text(_RUN)
    env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id}
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(memory_every), str(kill_at), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if kill_at >= 0:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        return None
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _files(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.slow
def test_a_killed_run_resumes_from_memory_exactly_as_if_never_killed(tmp_path, shm):
    reference = _run(tmp_path, tmp_path / "ref", "-", -1)
    _run(tmp_path, tmp_path / "root", 5, kill_at=27)
    steps = sorted(p.name for p in (tmp_path / "root").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_0", "step_20"]
    resumed = _run(tmp_path, tmp_path / "root", 5, -1)
    # Snapshot of step 25, newer than the volume's step 20: two steps trained again, not seven.
    assert (resumed["start"], resumed["tier"]) == (26, "memory")
    assert resumed["weights"] == reference["weights"]
    assert resumed["draws"] == {k: v for k, v in reference["draws"].items() if int(k) >= 26}
    assert _files(shm) == []  # the clean close removed every snapshot


def _train(ckpt, net, opt, steps):
    for step in steps:
        opt.zero_grad()
        net(torch.randn(2, net.in_features)).sum().backward()
        opt.step()
        ckpt.maybe_save(step, model=net, optimizer=opt)


def _net():
    net = torch.nn.Linear(4, 4)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def test_the_volume_wins_when_it_holds_a_newer_step(tmp_path, shm):
    net, opt = _net()
    with (
        pytest.raises(RuntimeError, match="stop"),
        CheckpointManager(tmp_path / "root", every=5, memory_every=10, async_save=False) as ckpt,
    ):
        _train(ckpt, net, opt, range(16))
        raise RuntimeError("stop")  # a failed run keeps its snapshots
    assert any(p.name.endswith(".slot") for p in shm.rglob("*"))
    with CheckpointManager(tmp_path / "root", memory_every=10, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 16  # volume 15 > memory 10
        assert again.restored_tier == "volume"
    restored = [e for e in events.log(kinds=["checkpoint_restored"]) if str(tmp_path) in e.message]
    assert restored[-1].fields["tier"] == "volume"


def test_a_run_restores_its_newest_snapshot_and_says_the_tier(tmp_path, shm):
    net, opt = _net()
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=10, memory_every=3, async_save=False) as ckpt,
    ):
        _train(ckpt, net, opt, range(13))
        saved = {k: v.clone() for k, v in net.state_dict().items()}  # as of step 12
        raise RuntimeError("killed")
    fresh, fresh_opt = _net()
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 13  # memory 12 > volume 10
        assert again.restored_tier == "memory"
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, saved[name])
    restored = events.log(kinds=["checkpoint_restored"])[-1]
    assert (restored.step, restored.fields["tier"]) == (12, "memory")
    assert _files(shm) == []


def test_a_restore_from_either_tier_tells_the_manager_the_same_things(tmp_path, shm):
    # One answer, whatever tier gave it: the step, the tier, the extra saved with the step,
    # the run id, and the newest checkpoint on the volume (which the next save follows).
    net, opt = _net()
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=10, memory_every=3, async_save=False) as ckpt,
    ):
        for step in range(13):
            opt.zero_grad()
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
            ckpt.maybe_save(step, model=net, optimizer=opt, extra={"seen": step})
        raise RuntimeError("killed")  # memory holds 12, the volume 10
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 13
        assert (again.restored_step, again.restored_tier) == (12, "memory")
        assert (again.extra, again.skipped, again.last_saved_step) == ({"seen": 12}, [], 10)
        assert again.mlflow_run_id is None
    with CheckpointManager(tmp_path / "root", async_save=False) as volume:  # no memory tier
        assert volume.restore(model=net, optimizer=opt) == 11
        assert (volume.restored_step, volume.restored_tier) == (10, "volume")
        assert (volume.extra, volume.skipped, volume.last_saved_step) == ({"seen": 10}, [], 10)
        assert volume.mlflow_run_id is None


class _CountingAdam(torch.optim.Adam):
    """The user's optimizer, counting its steps."""

    steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def _killed_linear_run(tmp_path, optimizer, width=4, steps=13):
    """Train a ``width`` square linear layer with ``optimizer`` for ``steps`` steps under a
    memory tier (snapshots every 3 steps), then fail: the snapshots stay. The model and
    optimizer."""
    torch.manual_seed(0)
    net = torch.nn.Linear(width, width)
    opt = optimizer(net.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=10, memory_every=3, async_save=False) as ckpt,
    ):
        _train(ckpt, net, opt, range(steps))
        raise RuntimeError("killed")
    return net, opt


def test_a_fresh_optimizer_takes_the_snapshot_state_without_a_step_of_its_own(tmp_path, shm):
    net, opt = _killed_linear_run(tmp_path, _CountingAdam)
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    saved_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = _CountingAdam(fresh.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 13
        assert again.restored_tier == "memory"
        # The state is the snapshot's, and no warm-up step ran to make room for it.
        assert fresh_opt.steps == 0
        assert all(p.grad is None for p in fresh.parameters())
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, saved[name])
        restored = list(fresh_opt.state.values())
        assert len(restored) == len(saved_opt)
        for i, state in enumerate(restored):
            assert state.keys() == saved_opt[i].keys()
            for key, value in state.items():
                assert torch.equal(value, saved_opt[i][key]), key
        # Training goes on from it as the killed run would have.
        _train(again, fresh, fresh_opt, range(13, 14))
        assert fresh_opt.steps == 1


def test_a_damaged_or_planted_snapshot_is_never_loaded(tmp_path, shm, caplog):
    net, opt = _net()
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=10, memory_every=3, async_save=False) as ckpt,
    ):
        _train(ckpt, net, opt, range(13))
        raise RuntimeError("killed")
    slots = sorted(shm.rglob("*.slot"), key=lambda p: p.stat().st_mtime)
    newest = slots[-1]
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in the payload: the checksum tells
    newest.write_bytes(bytes(data))
    planted = newest.parent / "r0-planted.slot"
    planted.write_bytes(newest.read_bytes())
    planted.chmod(0o644)  # mode 644: nobody's snapshot to trust
    caplog.set_level(logging.WARNING, logger="nbtools")
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 11  # the volume's step 10
        assert again.restored_tier == "volume"
    text = caplog.text
    assert "r0-planted.slot: owned by uid" in text and "mode 644" in text
    assert "does not match its checksum" in text


@pytest.mark.root
def test_a_slot_another_user_planted_is_skipped(tmp_path, shm, caplog):
    net, opt = _net()
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=10, memory_every=3, async_save=False) as ckpt,
    ):
        _train(ckpt, net, opt, range(13))
        raise RuntimeError("killed")
    newest = max(shm.rglob("*.slot"), key=lambda p: p.stat().st_mtime)
    os.chown(newest, 65534, 65534)  # nobody's now, mode still 600
    caplog.set_level(logging.WARNING, logger="nbtools")
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 11  # rank 0's step 12 is not trusted
        assert again.restored_tier == "volume"
    assert "owned by uid 65534" in caplog.text
    newest.unlink()


@pytest.mark.slow
def test_snapshots_of_a_job_whose_keeper_died_are_swept(tmp_path, shm):
    # A run started by hand keeps its own snapshots; killed, nobody restores them.
    _run(tmp_path, tmp_path / "root", 2, kill_at=5, run_id="")
    assert any(p.name.endswith(".slot") for p in shm.rglob("*"))
    with CheckpointManager(tmp_path / "other", memory_every=2):
        assert not any(p.name.endswith(".slot") for p in shm.rglob("*"))
    assert _files(shm) == []


@pytest.mark.root
def test_a_shared_memory_mount_too_small_warns_once_and_falls_back(
    tmp_path, mount_tmpfs, monkeypatch, caplog
):
    small = mount_tmpfs("64m")
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(small))
    big = torch.nn.Linear(2048, 2048)  # 16 MiB of weights, 48 MiB with Adam: two slots do not fit
    opt = torch.optim.Adam(big.parameters())
    big(torch.ones(1, 2048)).sum().backward()
    opt.step()
    caplog.set_level(logging.WARNING, logger="nbtools")
    with CheckpointManager(tmp_path / "root", memory_every=1, async_save=False) as ckpt:
        for step in range(3):
            ckpt.maybe_save(step, model=big, optimizer=opt)
    warnings = [
        r.getMessage() for r in caplog.records if "memory snapshots are off" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert (
        "MiB free" in warnings[0]
        and "--shm-size" in warnings[0]
        and "NBTOOLS_SNAPSHOT_DIR" in warnings[0]
    )
    assert not any(p.name.endswith(".slot") or p.name.startswith(".tmp-") for p in small.rglob("*"))


@pytest.mark.slow
def test_a_snapshot_killed_halfway_leaves_the_previous_one_whole(tmp_path, shm):
    writer = textwrap.dedent(
        """
        import os, sys, time
        from nbtools.checkpoint._memory import _directories, _slots
        user = _directories.user_dir()
        from nbtools._internal.holder import Holder
        job = _directories.job_dir(user, sys.argv[1], Holder.me())
        _slots.write_slot(job, sys.argv[1], 0, 1, 5, lambda fh: fh.write(b"x" * 1000))
        def half(fh):
            fh.write(b"y" * 500)
            print("halfway", flush=True)
            time.sleep(600)
        _slots.write_slot(job, sys.argv[1], 0, 1, 6, half)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", writer, "key"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "halfway"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    from nbtools.checkpoint._memory import _directories, _slots

    user = _directories.user_dir()
    job = _directories.job_path(user, "key")
    assert [s.step for s in _slots.slots(job, "key", 0, 1)] == [5]
    assert bytes(_slots.read_slot(next(_slots.slots(job, "key", 0, 1)))) == b"x" * 1000
    _directories.sweep(user)  # its keeper is dead: the job goes, the half-written file with it
    assert _files(shm) == [f"nbtools-snapshots-{os.geteuid()}"]
    os.rmdir(user)


def test_a_reused_slot_file_holds_only_the_new_snapshot(tmp_path, shm):
    from nbtools._internal.holder import Holder
    from nbtools.checkpoint._memory import _directories, _slots

    user = _directories.user_dir()
    job = _directories.job_dir(user, "key", Holder.me())
    old = _slots.write_slot(job, "key", 0, 1, 5, lambda fh: fh.write(b"x" * 100_000))
    keep = _slots.write_slot(job, "key", 0, 1, 6, lambda fh: fh.write(b"k" * 10))
    new = _slots.write_slot(job, "key", 0, 1, 7, lambda fh: fh.write(b"y" * 10), reuse=old)
    assert not os.path.exists(old.path) and os.stat(new.path).st_size == _slots.HEADER_BYTES + 10
    assert sorted(s.step for s in _slots.slots(job, "key", 0, 1)) == [6, 7]
    assert bytes(_slots.read_slot(new)) == b"y" * 10 and bytes(_slots.read_slot(keep)) == b"k" * 10

    def fails(fh):  # a write that fails while it overwrites a reused file
        fh.write(b"z" * 5)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        _slots.write_slot(job, "key", 0, 1, 8, fails, reuse=keep)
    assert [s.step for s in _slots.slots(job, "key", 0, 1)] == [7]  # no half-written slot
    assert sorted(os.listdir(job)) == ["keeper", os.path.basename(new.path)]
    _slots.remove([new.path])
    _directories.drop_job_if_empty(job)
    assert _files(shm) == []


@pytest.mark.parametrize(
    "bad, error", [(0, ValueError), (-3, ValueError), ("10", TypeError), (2.5, TypeError)]
)
def test_memory_every_must_be_a_positive_int(tmp_path, bad, error):
    with pytest.raises(error, match="memory_every"):
        CheckpointManager(tmp_path / "root", memory_every=bad)


def test_nothing_is_left_in_dev_shm_after_a_clean_close(tmp_path, monkeypatch):
    # The default base, /dev/shm, which other processes on this machine may use at the same
    # time: what is checked is this manager's own job directory and, when it made it, the
    # user's directory (left alone while another job of the user still has one there).
    monkeypatch.delenv("NBTOOLS_SNAPSHOT_DIR", raising=False)
    user = f"/dev/shm/nbtools-snapshots-{os.geteuid()}"
    made_user = not os.path.exists(user)
    net, opt = _net()
    with CheckpointManager(tmp_path / "root", memory_every=1, async_save=False) as ckpt:
        _train(ckpt, net, opt, range(3))
        job = ckpt._memory.directory
        assert os.path.dirname(job) == user, job
        assert os.listdir(job), job
    assert not os.path.exists(job), os.listdir(job)
    if made_user and os.path.isdir(user):
        others = [d for d in os.listdir(user) if not d.startswith(".")]
        assert others, f"{user} is left empty"


@pytest.mark.slow
def test_distributed_ranks_recover_from_memory_after_a_rank_is_killed(tmp_path, shm):
    from nbtools import distributed

    @distributed(processes=2, max_restarts=1, output="none")
    def train(root):
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with CheckpointManager(root, every=5, memory_every=2, async_save=False) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            for step in range(start, 10):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(2, 4)).sum().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 7 and dist.get_rank() == 1 and get_restart_count() == 0:
                    ckpt.wait()  # step 6's snapshot, written in the background, is complete
                    os.kill(os.getpid(), signal.SIGKILL)
        weights = [float(p.double().sum()) for p in net.parameters()]
        return get_restart_count(), ckpt.restored_step, ckpt.restored_tier, weights

    results = train.distributed(str(tmp_path / "root"))
    # The volume holds step 5; both ranks hold snapshots of step 6 (rank 1 died at 7).
    assert [r[:3] for r in results] == [(1, 6, "memory"), (1, 6, "memory")]
    # Bit-exact with an uninterrupted run.
    net = two_rank_reference(torch.optim.SGD, 10)
    assert results[0][3] == results[1][3] == [float(p.double().sum()) for p in net.parameters()]
    assert not any(p.is_file() for p in shm.rglob("*"))  # closed cleanly: removed


def test_a_launch_that_ended_for_good_drops_its_snapshots(tmp_path, shm, monkeypatch):
    from nbtools.checkpoint._memory import end_run

    net, opt = _net()
    for run in ("ended", "other"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run)
        with (
            pytest.raises(RuntimeError),
            CheckpointManager(tmp_path / run, memory_every=1, async_save=False) as ckpt,
        ):
            _train(ckpt, net, opt, range(2))
            raise RuntimeError("killed")  # kept for a restart
    assert len(end_run("ended")) == 1
    assert len(list(shm.rglob("*.slot"))) == 2  # the other run's two slots stay
    assert len(end_run("other")) == 1
    assert _files(shm) == []


def _slot_files(shm) -> list[str]:
    return [f for f in _files(shm) if f.endswith(".slot")]


def _fixed_step(net, opt):
    opt.zero_grad()
    net(torch.ones(2, 4)).sum().backward()
    opt.step()


def test_a_restore_keeps_its_slot_whole_until_the_optimizer_steps(tmp_path, shm):
    net, opt = _killed_linear_run(tmp_path, torch.optim.Adam)
    assert len(_slot_files(shm)) == 2  # steps 9 and 12
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    again = CheckpointManager(tmp_path / "root", memory_every=3, async_save=False)
    assert again.restore(model=fresh, optimizer=fresh_opt) == 13
    # The restored state lives in the slot's pages; until a step changes it the slot is
    # whole: a rank that dies here restores the same step again, bit for bit.
    assert len(_slot_files(shm)) == 2
    other = torch.nn.Linear(4, 4)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as third,
    ):
        assert third.restore(model=other, optimizer=other_opt) == 13
        assert third.restored_tier == "memory"
        raise RuntimeError("killed before its first step")  # a close on an error keeps slots
    for a, b in zip(other.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fresh.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # The first step moves the state off the slot's pages; training goes on exactly.
    _fixed_step(fresh, fresh_opt)
    _fixed_step(net, opt)
    for a, b in zip(fresh.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fresh_opt.state.values(), opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    _train(again, fresh, fresh_opt, range(13, 16))  # a snapshot at 15 writes a new slot
    again.close()
    assert _files(shm) == []


def _mapped_slots() -> list[str]:
    with open("/proc/self/maps") as fh:
        return [line.split()[-1] for line in fh if line.rstrip().endswith(".slot")]


def test_the_first_step_after_a_restore_in_place_leaves_the_slot_whole_and_unmapped(tmp_path, shm):
    # The optimizer state starts out in the restored slot's pages; the first step moves it
    # to memory of its own and the slot stays a valid slot of step 3 (restorable again).
    _killed_linear_run(tmp_path, torch.optim.Adam, width=256, steps=4)
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 4
        before = {p: p.read_bytes() for p in shm.rglob("*.slot")}
        assert _mapped_slots()  # the optimizer's state lives in the slot's pages
        _train(again, fresh, fresh_opt, range(4, 5))  # the first step: no snapshot
        assert {p: p.read_bytes() for p in shm.rglob("*.slot")} == before
        assert _mapped_slots() == []  # nothing of the process lives there any more
        other = torch.nn.Linear(256, 256)
        other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
        with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as third:
            assert third.restore(model=other, optimizer=other_opt) == 4
            assert third.restored_tier == "memory"
            third.close(final_save=False)
    assert _files(shm) == []


def test_a_second_manager_of_the_job_closing_leaves_the_first_snapshotting(tmp_path, shm):
    net, opt = _net()
    first = CheckpointManager(tmp_path / "root", every=100, memory_every=2, async_save=False)
    _train(first, net, opt, range(1))
    with CheckpointManager(tmp_path / "root", memory_every=2, async_save=False) as second:
        second.restore(model=net, optimizer=opt)
    _train(first, net, opt, range(1, 5))  # its directory went with the second's clean close
    first.wait()
    assert len(_slot_files(shm)) == 2  # steps 2 and 4
    first.close()
    assert _files(shm) == []


def test_a_manager_whose_directory_went_before_its_first_snapshot_snapshots(tmp_path, shm):
    net, opt = _net()
    first = CheckpointManager(tmp_path / "root", every=100, memory_every=2, async_save=False)
    with CheckpointManager(tmp_path / "root", memory_every=2, async_save=False) as second:
        second.restore(model=net, optimizer=opt)
    _train(first, net, opt, range(5))  # the directory went before its first snapshot
    first.wait()
    assert len(_slot_files(shm)) == 2  # steps 2 and 4
    first.close()
    assert _files(shm) == []


def _slot_rss_kb() -> int:
    """Resident kilobytes of every slot file this process maps (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = ".slot" in line
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


class _DeviceAdam(torch.optim.Adam):
    """Adam whose parameters live on another device (meta standing in for a GPU): as
    torch's Adam does for CUDA parameters, loading moves the moments there and keeps the
    0-dim ``step`` tensors on the CPU."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, value in state.items():
                if key != "step":
                    state[key] = value.to("meta")


def test_a_restore_onto_another_device_keeps_no_page_of_the_slot_mapped(tmp_path, shm):
    _killed_linear_run(tmp_path, torch.optim.Adam, width=256, steps=4)
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = _DeviceAdam(fresh.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 4
        assert again.restored_tier == "memory"
        steps = [s["step"] for s in fresh_opt.state.values()]
        assert [t.device.type for t in steps] == ["cpu", "cpu"]
        assert all(s["exp_avg"].is_meta for s in fresh_opt.state.values())
        # The moments went to the device; the step tensors have memory of their own.
        assert _mapped_slots() == [] and _slot_rss_kb() == 0
        assert [int(t) for t in steps] == [4, 4]


def test_a_restore_in_place_keeps_slot_pages_mapped_only_until_the_first_step(tmp_path, shm):
    _killed_linear_run(tmp_path, torch.optim.Adam, width=256, steps=4)
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 4
        assert _slot_rss_kb() >= 2 * 256 * 256 * 4 // 1024  # the moments live there
        _train(again, fresh, fresh_opt, range(4, 5))
        assert _slot_rss_kb() == 0


class _CopyingAdam(torch.optim.Adam):
    """An optimizer that copies the state it loads (as one moving it to a GPU does)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, value in state.items():
                state[key] = value.clone()


def test_an_optimizer_that_copies_its_state_leaves_the_slot_in_place(tmp_path, shm):
    net, opt = _killed_linear_run(tmp_path, _CopyingAdam)
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = _CopyingAdam(fresh.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=fresh, optimizer=fresh_opt) == 13
        _fixed_step(fresh, fresh_opt)
        _fixed_step(net, opt)
        assert len(_slot_files(shm)) == 2  # nothing lives in the slot: it stays a slot
        for a, b in zip(fresh.state_dict().values(), net.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    assert _files(shm) == []
