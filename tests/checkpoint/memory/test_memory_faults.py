"""The memory tier under faults: damaged headers, repeated failures, untrusted directories."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from ckpt_training import two_rank_reference

from nbtools.checkpoint._memory import _directories, _slots

# A run defined in __main__ (as in a notebook cell) whose every step draws from the global
# RNG: a resume that lost a step or the RNG streams shows in the weights.
_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from nbtools.checkpoint import CheckpointManager

    root, kill_at, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    ckpt = CheckpointManager(root, every=20, memory_every=4)
    start = ckpt.restore(model=net, optimizer=opt)
    for step in range(start, steps):
        opt.zero_grad()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        ckpt.maybe_save(step, model=net, optimizer=opt)
        if step == kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    print(json.dumps({"start": start, "tier": ckpt.restored_tier,
                      "weights": [p.double().sum().item() for p in net.parameters()]}))
    """
)


def _run(tmp_path, root, kill_at, steps=24, run_id="faults"):
    script = tmp_path / "train.py"
    script.write_text(_RUN)
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if run_id:
        env["TORCHELASTIC_RUN_ID"] = run_id
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(kill_at), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if kill_at >= 0:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        return None, proc.stderr
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _header(path) -> tuple[bytes, dict]:
    data = path.read_bytes()
    head = data[: _slots.HEADER_BYTES]
    return data, json.loads(head[len(b"NBTSNAP3") :].decode())


@pytest.mark.slow
@pytest.mark.parametrize("resealed", [False, True], ids=["flipped", "flipped-and-resealed"])
def test_a_slot_whose_header_claims_another_step_is_never_restored(tmp_path, shm, resealed):
    reference, _ = _run(tmp_path, tmp_path / "ref", -1)
    _run(tmp_path, tmp_path / "root", kill_at=13)  # after the step-12 snapshot
    slots = {_header(p)[1]["step"]: p for p in shm.rglob("*.slot")}
    assert sorted(slots) == [8, 12]
    data, head = _header(slots[12])
    if resealed:  # a header that agrees with its own checksum: the snapshot's step tells
        block = _slots._sealed({k: v for k, v in head.items() if k != "head_crc"} | {"step": 10})
    else:  # the flipped bits of the issue: "step": 12 read as "step": 10
        block = data[: _slots.HEADER_BYTES].replace(b'"step": 12', b'"step": 10')
    slots[12].write_bytes(block + data[_slots.HEADER_BYTES :])
    resumed, stderr = _run(tmp_path, tmp_path / "root", -1)
    # Step 12's slot is skipped, with one warning; step 8 (the next candidate) is restored.
    assert (resumed["start"], resumed["tier"]) == (9, "memory")
    assert resumed["weights"] == reference["weights"]
    why = "holds step 12 where its header says 10" if resealed else "does not match its checksum"
    assert stderr.count(why) == 1, stderr


def _two_ranks(root, log, second_kill, replicas):
    from nbtools import distributed

    @distributed(processes=2, max_restarts=2, output="none")
    def train(root, log, second_kill, replicas):
        import glob
        import os
        import signal

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        restart, rank = get_restart_count(), dist.get_rank()
        every = {"every": 100, "memory_every": 4, "replicas": replicas}
        with CheckpointManager(root, async_save=False, **every) as ckpt:
            start = ckpt.restore(model=net, optimizer=opt)
            with open(log, "a") as fh:
                fh.write(f"{restart} {rank} {ckpt.restored_step} {ckpt.restored_tier}\n")
            for step in range(start, 20):
                torch.manual_seed(step)
                opt.zero_grad()
                net(torch.randn(2, 4)).sum().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if restart == 0 and step == 12:
                    ckpt.wait()  # right after the step-12 snapshot, complete on every rank
                    dist.barrier()
                    if rank == 1:
                        if replicas:  # its own slot of step 12 damaged: its replica serves
                            for path in glob.glob(f"{os.environ['NBTOOLS_SNAPSHOT_DIR']}/*/*/r1-*"):
                                with open(path, "r+b") as fh:
                                    if b'"step": 12' in fh.read(4096):
                                        fh.seek(-1, os.SEEK_END)
                                        fh.write(b"?")
                        os.kill(os.getpid(), signal.SIGKILL)
                if rank == 1 and restart == 1 and step == second_kill:
                    if step % 4:
                        ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)  # at 16: during its snapshot
        return [p.double().sum().item() for p in net.parameters()]

    return train.distributed(root, log, second_kill, replicas)


def _reference():
    return [p.double().sum().item() for p in two_rank_reference(torch.optim.Adam, 20).parameters()]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("second_kill", "replicas"),
    [(14, 0), (16, 0), (14, 1)],
    ids=["before-the-next-snapshot", "during-it", "restored-from-a-replica"],
)
def test_a_second_failure_after_a_recovery_goes_back_at_most_memory_every(
    tmp_path, shm, second_kill, replicas
):
    log = tmp_path / "restores.txt"
    weights = _two_ranks(str(tmp_path / "root"), str(log), second_kill, replicas)
    restores = {tuple(line.split()[:2]): line.split()[2:] for line in log.read_text().splitlines()}
    assert restores[("0", "0")] == restores[("0", "1")] == ["None", "None"]
    # (The ranks of a node split their replicated tensors: rank 0 reads rank 1's share too.)
    assert (
        restores[("1", "0")] == restores[("1", "1")] == ["12", "replica" if replicas else "memory"]
    )
    # The restored step stays restorable until a newer snapshot is published: step 12 (or
    # 16, when the killed rank's snapshot of it was published), never step 8.
    for rank in "01":
        step, tier = restores[("2", rank)]
        assert int(step) >= 12 and tier in ("memory", "replica"), restores
    assert weights[0] == weights[1] == _reference()
    assert not any(p.is_file() for p in shm.rglob("*"))


_root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
_OTHER = 1001  # another local user


def _plant(shm, how):
    """The predictable snapshot directory, made by another local user first."""
    path = shm / f"nbtools-snapshots-{os.geteuid()}"
    if how == "other-owner":
        path.mkdir(mode=0o777)
        os.chmod(path, 0o777)
        os.chown(path, _OTHER, _OTHER)
    else:
        target = shm / "elsewhere"
        target.mkdir()
        os.chown(target, _OTHER, _OTHER)
        path.symlink_to(target)
    return path


@pytest.mark.slow
@pytest.mark.root
@_root_only
@pytest.mark.parametrize("how", ["other-owner", "symlink"])
def test_a_snapshot_directory_another_user_planted_never_stops_training(tmp_path, shm, how):
    planted = _plant(shm, how)
    reference, _ = _run(tmp_path, tmp_path / "ref", -1)
    _, stderr = _run(tmp_path, tmp_path / "root", kill_at=13)
    # Not a file in the planted directory: the snapshots went to a private one.
    assert not any(p.name.endswith(".slot") for p in shm.rglob("*") if planted in p.parents)
    private = [p for p in shm.iterdir() if p.name.startswith(f"{planted.name}-")]
    assert len(private) == 1 and private[0].stat().st_mode & 0o777 == 0o700
    assert stderr.count("snapshots go to the private directory") == 1, stderr
    resumed, _ = _run(tmp_path, tmp_path / "root", -1)
    assert (resumed["start"], resumed["tier"]) == (13, "memory")  # the restart found them
    assert resumed["weights"] == reference["weights"]
    assert (
        sorted(p.name for p in shm.iterdir())
        == sorted(["elsewhere", planted.name])[1 - (how == "symlink") :]
    )


@pytest.mark.slow
@pytest.mark.root
@_root_only
def test_a_job_directory_opened_to_others_after_a_kill_means_the_volume(tmp_path, shm):
    reference, _ = _run(tmp_path, tmp_path / "ref", -1)
    _run(tmp_path, tmp_path / "root", kill_at=13)
    (job,) = shm.glob("nbtools-snapshots-*/job-*")
    job.chmod(0o777)  # anyone may have planted a slot there since

    planted = job / "r0-planted.slot"  # another local user's file, planted there
    planted.write_bytes(b"\0" * 8192)
    os.chown(planted, _OTHER, _OTHER)
    resumed, stderr = _run(tmp_path, tmp_path / "root", -1)
    # No memory tier for this job, said once; the volume's step 0, then exactly as never killed.
    assert (resumed["start"], resumed["tier"]) == (1, "volume")
    assert resumed["weights"] == reference["weights"]
    assert stderr.count("no memory snapshots for this job") == 1, stderr
    assert planted.exists()  # another user's file is not this job's to touch


# One process of the race: make job directories and sweep, in a tight loop. Its jobs are
# alive (it is their keeper), so no sweep may remove them while it uses them.
_CREATE_AND_SWEEP = textwrap.dedent(
    """
    import os, sys, time
    from nbtools._internal.holder import Holder
    from nbtools.checkpoint._memory import _directories, _slots

    base, name, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    me = Holder.me()
    made, lost = 0, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        user = _directories.user_dir(base)
        key = f"run:{name}-{made}|root|world=1"
        own = _directories.job_path(user, key)
        _directories.sweep_all(base, own=own)
        job = _directories.job_dir(user, key, me)
        slot = os.path.join(job, "r0-x.slot")
        try:
            with open(slot, "w") as fh:
                fh.write("snapshot")
            if not os.path.exists(os.path.join(job, _directories.KEEPER)):
                lost.append(job)
        except FileNotFoundError:
            lost.append(job)
        _slots.remove([slot])
        _directories.drop_job_if_empty(job)
        made += 1
    print(made, len(lost))
    """
)


@pytest.mark.slow
def test_the_sweep_never_touches_a_job_being_created(tmp_path, shm):
    script = tmp_path / "race.py"
    script.write_text(_CREATE_AND_SWEEP)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(shm), f"p{i}", "6"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err  # no FileNotFoundError from job_dir
        made, lost = (int(v) for v in out.split())
        assert made > 100 and lost == 0, (made, lost)
    assert list(shm.iterdir()) == []


@pytest.mark.slow
def test_a_sweep_removes_everything_a_dead_job_left(tmp_path, shm):

    # A run started by hand is its own keeper: killed, its snapshots serve nobody.
    _run(tmp_path, tmp_path / "root", kill_at=9, run_id="")
    (user,) = shm.iterdir()
    (job,) = user.iterdir()
    (job / ".tmp-r0-r0-half").write_bytes(b"half-written")  # a write the kill cut short
    stale = user / f"{_directories.NEW}killed"  # a job directory whose maker died making it
    stale.mkdir()
    os.utime(stale, (0, 0))
    (user / "stray").write_text("not a job directory")
    assert len(list(job.glob("*.slot"))) == 2
    removed = _directories.sweep_all(str(shm))
    assert sorted(removed) == sorted([job.name, stale.name, "stray"])
    assert list(shm.iterdir()) == []  # the user's directory, left empty, goes too


def test_a_launch_that_ended_drops_its_snapshots_wherever_they_went(tmp_path, shm, monkeypatch):
    from nbtools._internal.holder import Holder
    from nbtools.checkpoint._memory import end_run

    usual = _directories.user_dir(str(shm))
    private = _directories.private_dir("run:ended", str(shm))  # where a planted base sent it
    for user, run in [(usual, "ended"), (private, "ended"), (usual, "other")]:
        job = _directories.job_dir(user, f"run:{run}|root|world=1", Holder.me())
        (pathlib.Path(job) / "r0-x.slot").write_bytes(b"snapshot")
    assert len(end_run("ended", base=str(shm))) == 2
    assert [p.name for p in shm.iterdir()] == [os.path.basename(usual)]  # the other run's
    assert len(end_run("other", base=str(shm))) == 1
    assert list(shm.iterdir()) == []


def _train(ckpt, net, opt, steps):
    for step in steps:
        opt.zero_grad()
        net(torch.ones(2, 4)).sum().backward()
        opt.step()
        ckpt.maybe_save(step, model=net, optimizer=opt)


def _messages(caplog, text):
    return [r for r in caplog.records if text in r.getMessage()]


def test_a_truncated_slot_is_reported_once_not_at_every_snapshot(tmp_path, shm, caplog):
    from nbtools.checkpoint import CheckpointManager

    caplog.set_level(logging.WARNING, logger="nbtools")
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "root", memory_every=1, async_save=False) as ckpt:
        _train(ckpt, net, opt, range(2))
        ckpt.wait()
        slot = next(shm.rglob("*.slot"))
        truncated = slot.with_name("r0-truncated.slot")
        truncated.write_bytes(slot.read_bytes()[:-100])
        truncated.chmod(0o600)
        _train(ckpt, net, opt, range(2, 40))  # 38 snapshots list the slots again
    assert len(_messages(caplog, "r0-truncated.slot")) == 1
    assert not truncated.exists()  # the clean close removed it with the job


@pytest.mark.parametrize("damage", ["payload", "missing"])
def test_a_restore_that_falls_back_says_why_in_one_line(tmp_path, shm, caplog, damage):
    from nbtools.checkpoint import CheckpointManager

    net = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError),
        CheckpointManager(tmp_path / "root", every=4, memory_every=3, async_save=False) as ckpt,
    ):
        _train(ckpt, net, opt, range(10))
        raise RuntimeError("killed")  # slots of steps 6 and 9 kept; the volume holds 8
    newest = max(shm.rglob("*.slot"), key=lambda p: _header(p)[1]["step"])
    if damage == "payload":
        data = bytearray(newest.read_bytes())
        data[-100] ^= 0xFF
        newest.write_bytes(bytes(data))
    else:
        newest.unlink()
    caplog.set_level(logging.INFO, logger="nbtools")
    with CheckpointManager(tmp_path / "root", memory_every=3, async_save=False) as again:
        assert again.restore(model=net, optimizer=opt) == 9  # the volume's step 8
        assert again.restored_tier == "volume"
    if damage == "payload":  # step 9 failed its check: step 6 is older than the volume's
        (line,) = _messages(caplog, "failed their checks")
        assert "step 9" in line.getMessage() and line.levelno == logging.WARNING
    (newer,) = _messages(caplog, "the volume's step 8 is newer than memory's 6")
    assert newer.levelno == logging.INFO  # not a fault: the volume is newer


@pytest.mark.slow
@pytest.mark.root
def test_a_full_snapshot_filesystem_is_reported_once_by_each_holder(
    tmp_path, mount_tmpfs, monkeypatch
):
    from nbtools import distributed

    small = mount_tmpfs("8m")
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(small))

    @distributed(processes=2, output="none")
    def train(root, filler):
        import logging
        import os
        import shutil

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager

        said = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("nbtools").addHandler(handler)
        net = torch.nn.Linear(256, 256)
        opt = torch.optim.Adam(net.parameters(), lr=0.1)
        with CheckpointManager(root, memory_every=2, replicas=1, async_save=False) as ckpt:
            for step in range(1, 21):
                opt.zero_grad()
                net(torch.ones(2, 256)).sum().backward()
                opt.step()
                ckpt.maybe_save(step, model=net, optimizer=opt)
                if step == 3:  # the first snapshots and replicas are kept; then it fills up
                    ckpt.wait()
                    dist.barrier()
                    if dist.get_rank() == 0:
                        with open(filler, "wb") as fh:
                            free = shutil.disk_usage(os.path.dirname(filler)).free
                            os.posix_fallocate(fh.fileno(), 0, free - 2**16)  # tails fit
                    dist.barrier()
            snapshots = sorted(ckpt._memory.steps())
            ckpt.wait()
            dist.barrier()
        if dist.get_rank() == 0:
            os.unlink(filler)
        logging.getLogger("nbtools").removeHandler(handler)
        return snapshots, [m for m in said if "was not kept" in m]

    results = train.distributed(str(tmp_path / "root"), str(small / "filler"))
    for snapshots, lost in results:
        assert snapshots == [18, 20]  # each rank's own snapshots go on (their files rotate)
        # Nine rounds could not keep the peer's replica: said once, by the rank holding it.
        assert len(lost) == 1 and "No space left on device" in lost[0], lost
    assert not any(p.is_file() for p in small.rglob("*"))
