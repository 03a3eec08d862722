"""Saving into a directory that holds a complete checkpoint replaces it atomically.

The kill tests run one driver process that imports torch once and forks a
child per kill point. The child arms a profiler hook that SIGKILLs it at the
k-th call made by nbtools' checkpoint code (any thread) while it replaces the
checkpoint in ``step_8``; another forked child then loads the directory. The
points are spread from the marker through upload and verification, and take
every call from publishing ``.metadata`` to the end (removing the old files).
After every kill the directory loads, bit-exact, as the old or the new
checkpoint, never a mix; after a last clean save it holds nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from nbtools.checkpoint import VolumeReader, VolumeWriter, find_latest_valid
from nbtools.errors import CheckpointError

DRIVER = textwrap.dedent(
    r"""
    import json, os, signal, sys, threading, warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from nbtools.checkpoint import VolumeReader, VolumeWriter, find_latest_valid
    from nbtools.checkpoint.discovery import validate
    from nbtools.checkpoint._storage._target import open_target

    url, out_file, points_wanted = sys.argv[1], sys.argv[2], int(sys.argv[3])
    path = url + "/step_8"
    MARK = os.sep + os.path.join("nbtools", "checkpoint") + os.sep

    def state(version):
        g = torch.Generator().manual_seed(version)
        return {
            "model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(64, generator=g)},
            "optim": {"m": torch.randn(300, 70, generator=g)},
            "step": version,
            "note": f"version {version}",
        }

    def blank():
        return {
            "model": {"w": torch.zeros(256, 256), "b": torch.zeros(64)},
            "optim": {"m": torch.zeros(300, 70)},
            "step": -1,
            "note": "",
        }

    def same(a, b):
        return (
            all(torch.equal(a[k][n], b[k][n]) for k in ("model", "optim") for n in a[k])
            and a["step"] == b["step"] and a["note"] == b["note"]
        )

    def forked(*steps):
        # Runs the steps in one forked child (one S3 session), each result one line on a
        # pipe as soon as it is known: a step killed later loses nothing already sent.
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                for fn in steps:
                    os.write(w, (json.dumps(fn()) + "\n").encode())
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        chunks = []
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        lines = b"".join(chunks).decode().splitlines()
        return status, [json.loads(line) for line in lines]

    def replace(version, kill_at):
        # kill_at > 0: the kill_at-th call; kill_at <= 0: the (1 - kill_at)-th call after
        # publishing .metadata starts.
        count = [0, -1]
        def hook(frame, event, arg):
            if event in ("call", "c_call") and MARK in frame.f_code.co_filename:
                count[0] += 1
                if (event == "call" and frame.f_code.co_name == "publish_bytes"
                        and frame.f_locals.get("rel") == ".metadata" and count[1] < 0):
                    count[1] = count[0]
                if count[0] == kill_at or (
                    kill_at <= 0 and count[1] > 0 and count[0] == count[1] + 1 - kill_at
                ):
                    os.kill(os.getpid(), signal.SIGKILL)
        sd = state(version)
        if "://" in url:  # fsspec's IO thread starts unhooked: only nbtools' calls count
            import fsspec.asyn
            fsspec.asyn.get_loop()
        threading.setprofile(hook)
        sys.setprofile(hook)
        dcp.save(sd, storage_writer=VolumeWriter(path), no_dist=True)
        sys.setprofile(None)
        threading.setprofile(None)
        return count

    def check():
        # What a restarted run sees: the documented discovery, then a load by both readers.
        found = find_latest_valid(url, verify=True)
        got = blank()
        dcp.load(got, storage_reader=VolumeReader(path), no_dist=True)
        version = got["step"]
        loaded = {"vol": same(got, state(version))}
        if "://" not in url:
            again = blank()
            dcp.load(again, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            loaded["fs"] = same(again, got)
        validate(open_target(path), path, verify=True)
        return {"version": version, "found": found, "loaded": loaded}

    def listing():
        target = open_target(path)
        from nbtools.checkpoint._storage._safe_pickle import read_metadata
        named = {i.relative_path for i in read_metadata(target, path).storage_data.values()}
        return {"names": sorted(target.listdir()), "named": sorted(named)}

    def save(version):
        return lambda: (dcp.save(state(version), storage_writer=VolumeWriter(path), no_dist=True), 0)[1]

    status, _ = forked(save(1))
    assert status == 0, status
    status, [(total, publish_at)] = forked(lambda: replace(2, 10**9))
    assert status == 0, status
    # Half before publishing, spread evenly; then the publish and the calls right after
    # it one by one, and the rest spread to the end (removing the old files, the marker).
    before = max(2, points_wanted // 2)
    points = sorted({1 + i * (publish_at - 2) // (before - 1) for i in range(before)})
    tail, spread = total - publish_at, max(1, points_wanted - before - 4)
    points += sorted({-d for d in range(4)} | {-(4 + i * (tail - 4) // spread) for i in range(spread)})[::-1]
    # Each child first loads what the previous kill left, then replaces it and is killed.
    results, current, pending = [], 2, None
    for i, kill_at in enumerate(points + [None]):
        version = 3 + i
        steps = [check] + ([] if kill_at is None else [lambda: replace(version, kill_at)])
        status, out = forked(*steps)
        seen = out[0] if out else None
        if pending is not None:
            pending.update(seen=seen, check_status=0 if seen is not None else status)
            results.append(pending)
            if seen is not None:
                current = seen["version"]
        if kill_at is not None:
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            pending = {"kill_at": kill_at, "killed": killed, "status": status, "old": current,
                       "new": version}
    status, out = forked(save(99), check, listing)
    assert status == 0, status
    _, final, files = out
    with open(out_file, "w") as fh:
        json.dump({"total": total, "publish_at": publish_at, "results": results,
                   "final": final, "files": files}, fh)
    """
)


def _run_driver(tmp_path, url: str, points: int, env: dict | None = None) -> dict:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(script), url, str(out), str(points)],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_old_or_new(report: dict, url: str) -> None:
    results = report["results"]
    for r in results:
        assert r["check_status"] == 0, r  # it loaded
        seen = r["seen"]
        assert seen["found"] == f"{url}/step_8", r
        assert seen["version"] in (r["old"], r["new"]), r  # one of the two, bit-exact:
        assert all(seen["loaded"].values()), r
        assert r["killed"] or (r["kill_at"] <= 0 and r["status"] == 0), r
    killed = [r for r in results if r["killed"]]
    assert len(killed) >= len(results) - 1
    # Kills landed both before the new metadata was published (old kept) and after it.
    assert any(r["seen"]["version"] == r["old"] for r in killed), results
    assert any(r["seen"]["version"] == r["new"] for r in killed), results
    # A last clean save: the new checkpoint, and no file of any earlier or killed save.
    assert report["final"]["version"] == 99 and all(report["final"]["loaded"].values())
    files = report["files"]
    assert files["names"] == sorted([".metadata", *files["named"]]), files


@pytest.mark.slow
def test_sigkill_while_replacing_a_local_checkpoint_leaves_old_or_new(tmp_path):
    root = tmp_path / "root"
    report = _run_driver(tmp_path, str(root), 26)
    _assert_old_or_new(report, str(root))


# --- in one process -------------------------------------------------------------------


def _state(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(32, 8, generator=g), "step": version}


def _blank() -> dict:
    return {"w": torch.zeros(32, 8), "step": -1}


@pytest.fixture(autouse=True)
def _quiet_single_process_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load(path, reader=VolumeReader) -> dict:
    got = _blank()
    dcp.load(got, storage_reader=reader(path))
    return got


class _HeldPlanner(DefaultSavePlanner):
    """A save planner that holds the save in ``write_data`` until ``release`` is set."""

    def __init__(self, reached: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self._reached, self._release = reached, release

    def resolve_data(self, write_item):  # DCP's signature
        self._reached.set()
        assert self._release.wait(60)
        return super().resolve_data(write_item)


def test_replacing_a_checkpoint_pytorch_wrote_and_reading_it_back_with_pytorch(tmp_path):
    path = tmp_path / "step_8"
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(path))
    old = set(os.listdir(path))
    dcp.save(_state(2), storage_writer=VolumeWriter(path))
    for reader in (VolumeReader, dcp.FileSystemReader):
        got = _load(path, reader)
        assert got["step"] == 2 and torch.equal(got["w"], _state(2)["w"])
    new = set(os.listdir(path))
    assert ".metadata" in new and not (new - {".metadata"}) & old  # old shards removed
    assert not [n for n in new if n.startswith(".nbtools")]  # no marker left


def test_a_second_save_into_a_directory_being_written_is_refused(tmp_path):
    path = tmp_path / "step_8"
    dcp.save(_state(1), storage_writer=VolumeWriter(path))
    reached, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            dcp.save(
                _state(2), storage_writer=VolumeWriter(path), planner=_HeldPlanner(reached, release)
            )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert reached.wait(60)
        with pytest.raises(BaseException) as info:
            dcp.save(_state(3), storage_writer=VolumeWriter(path))
        text = str(info.value)
        assert "another save is writing into" in text and f"pid {os.getpid()}" in text
        assert _load(path)["step"] == 1  # untouched by the refused save
    finally:
        release.set()
        thread.join(60)
    assert errors == []
    assert _load(path)["step"] == 2
    assert not [n for n in os.listdir(path) if n.startswith(".nbtools")]


@pytest.mark.slow
def test_a_save_of_another_live_process_here_is_refused(tmp_path):
    # A real second process holds a save into the directory in write_data.
    path = tmp_path / "step_8"
    dcp.save(_state(1), storage_writer=VolumeWriter(path))
    held = tmp_path / "held"
    code = textwrap.dedent(
        f"""
        import os, sys, time, warnings
        warnings.filterwarnings("ignore")
        import torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from nbtools.checkpoint import VolumeWriter
        class Held(DefaultSavePlanner):
            def resolve_data(self, item):
                open({str(held)!r} + ".reached", "w").close()
                while not os.path.exists({str(held)!r} + ".go"):
                    time.sleep(0.05)
                return super().resolve_data(item)
        dcp.save({{"w": torch.ones(32, 8), "step": 5}}, storage_writer=VolumeWriter({str(path)!r}),
                 planner=Held())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if os.path.exists(f"{held}.reached") or proc.poll() is not None:
                break
            threading.Event().wait(0.05)
        assert os.path.exists(f"{held}.reached"), proc.stderr.read() if proc.poll() else ""
        with pytest.raises(BaseException) as info:
            dcp.save(_state(3), storage_writer=VolumeWriter(path))
        assert f"pid {proc.pid}" in str(info.value)
        assert _load(path)["step"] == 1
    finally:
        open(f"{held}.go", "w").close()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert _load(path)["step"] == 5


@pytest.mark.slow
def test_a_marker_left_by_a_killed_process_does_not_block_and_is_cleaned(tmp_path):
    path = tmp_path / "step_8"
    dcp.save(_state(1), storage_writer=VolumeWriter(path))
    # A save killed after its marker and one shard: a real process, really killed.
    code = textwrap.dedent(
        f"""
        import os, signal, warnings
        warnings.filterwarnings("ignore")
        import torch, torch.distributed.checkpoint as dcp
        from nbtools.checkpoint import VolumeWriter, writer
        real = writer.VolumeWriter._write_one
        def die(self, stage, name, *args):
            out = real(self, stage, name, *args)
            os.kill(os.getpid(), signal.SIGKILL)
        writer.VolumeWriter._write_one = die
        dcp.save({{"w": torch.ones(32, 8), "step": 5}}, storage_writer=VolumeWriter({str(path)!r}),
                 no_dist=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = set(os.listdir(path))
    assert any(n.startswith(".nbtools-saving-") for n in left)
    assert _load(path)["step"] == 1  # the old checkpoint is whole
    dcp.save(_state(2), storage_writer=VolumeWriter(path))
    assert _load(path)["step"] == 2
    names = set(os.listdir(path))
    assert not names & (left - {".metadata"}) and not [n for n in names if n.startswith(".nbtools")]


def test_another_machines_unfinished_save_is_left_alone(tmp_path, caplog):
    # The one thing faked: a marker of another machine (the boundary: no second host here).
    path = tmp_path / "step_8"
    dcp.save(_state(1), storage_writer=VolumeWriter(path))
    record = {"pid": 1, "started": 0.0, "machine": "elsewhere", "host": "node-b", "time": 4e9}
    (path / ".nbtools-saving-0123456789abcdef").write_text(json.dumps(record))
    (path / "__0_0.0123456789abcdef.distcp").write_bytes(b"being written on node-b")
    with caplog.at_level("WARNING", logger="nbtools"):
        dcp.save(_state(2), storage_writer=VolumeWriter(path))
    assert "a save of another machine" in caplog.text and "node-b" in caplog.text
    assert _load(path)["step"] == 2
    names = set(os.listdir(path))
    assert {".nbtools-saving-0123456789abcdef", "__0_0.0123456789abcdef.distcp"} <= names
    # An old marker of that machine counts as left by a dead save: cleaned at the next save.
    record["time"] = 1.0
    (path / ".nbtools-saving-0123456789abcdef").write_text(json.dumps(record))
    dcp.save(_state(3), storage_writer=VolumeWriter(path))
    names = set(os.listdir(path))
    assert not {".nbtools-saving-0123456789abcdef", "__0_0.0123456789abcdef.distcp"} & names
    assert _load(path)["step"] == 3


def test_rank_local_saves_still_refuse_a_complete_checkpoint(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(1), storage_writer=VolumeWriter(path), use_collectives=False)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(2), storage_writer=VolumeWriter(path), use_collectives=False)
    assert "one metadata file per rank" in str(info.value)
    assert isinstance(info.value, CheckpointError) or "CheckpointError" in repr(info.value)


def test_the_documented_resume_loop_saves_its_restored_step_again(tmp_path):
    # The reference's loop: restore the newest step_N, start at N and save N again.
    root = tmp_path / "checkpoints"

    def run(total_steps: int) -> list[int]:
        latest = find_latest_valid(str(root))
        start_step = 0
        w = torch.zeros(4)
        if latest is not None:
            state = {"w": w, "step": 0}
            dcp.load(state, storage_reader=VolumeReader(latest))
            start_step = state["step"]
        saved = []
        for step in range(start_step, total_steps):
            w += 1
            if step % 4 == 0:
                dcp.save({"w": w, "step": step}, storage_writer=VolumeWriter(root / f"step_{step}"))
                saved.append(step)
        return saved

    assert run(9) == [0, 4, 8]
    assert run(13) == [8, 12]  # step 8 saved again: replaced, not refused
    got = {"w": torch.zeros(4), "step": 0}
    dcp.load(got, storage_reader=VolumeReader(root / "step_12"))
    assert got["step"] == 12


def test_a_load_planned_on_the_old_checkpoint_fails_naming_the_file(tmp_path):
    # What the README says: a load that read the old .metadata before the replacement and
    # opens the shards after it gets an error naming a missing file, never mixed data.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    path = tmp_path / "step_8"
    dcp.save(_state(1), storage_writer=VolumeWriter(path))
    old = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))

    class ReplacedMeanwhile(DefaultLoadPlanner):
        def set_up_planner(self, *args, **kwargs):
            super().set_up_planner(*args, **kwargs)
            saver = threading.Thread(
                target=dcp.save, args=(_state(2),), kwargs={"storage_writer": VolumeWriter(path)}
            )
            saver.start()
            saver.join(60)

    got = _blank()
    with pytest.raises(BaseException) as info:
        dcp.load(got, storage_reader=VolumeReader(path), planner=ReplacedMeanwhile())
    assert any(name in str(info.value) for name in old), info.value
    assert _load(path)["step"] == 2


def test_the_verdict_before_a_save_says_new_replace_or_refuse_as_one_typed_value(tmp_path):
    # Rank 0's verdict travels to every rank; each case is a named value, the error
    # (when there is one) rides along instead of being the verdict itself.
    from nbtools.checkpoint._checks import SaveCase, SaveVerdict, save_verdict
    from nbtools.checkpoint.discovery import is_foreign, root_target

    target = root_target(str(tmp_path))
    assert save_verdict(target, None, str(tmp_path), "step_1", is_foreign) == SaveVerdict(
        SaveCase.NEW
    )
    dcp.save({"w": torch.ones(2)}, storage_writer=VolumeWriter(str(tmp_path / "step_1")))
    verdict = save_verdict(target, None, str(tmp_path), "step_1", is_foreign)
    assert verdict == SaveVerdict(SaveCase.REPLACE)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "step_2")
    verdict = save_verdict(target, None, str(tmp_path), "step_2", is_foreign)
    assert verdict.case is SaveCase.REFUSE
    assert isinstance(verdict.error, CheckpointError) and "symbolic link" in str(verdict.error)
