"""One writer per root: a second run saving into the same root is refused, naming the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from ckpt_training import Net

from nbtools._internal.holder import machine_id as _machine
from nbtools.checkpoint import CheckpointManager, find_latest_valid
from nbtools.checkpoint._lease import LEASE_NAME
from nbtools.errors import CheckpointError

# A run saving every step with keep=1 until told to stop. It reports as JSON lines:
# {"saved": step} after each save, then {"error": ...} or {"done": last_step}.
WRITER = textwrap.dedent(
    r"""
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    from nbtools.checkpoint import CheckpointManager

    root, stop = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(32, 32)
    def say(**kw):
        print(json.dumps(kw), flush=True)
    try:
        with CheckpointManager(root, every=1, keep=1) as ckpt:
            step = 0
            while not os.path.exists(stop) and step < 100000:
                ckpt.maybe_save(step, model=model)
                ckpt.wait()
                say(saved=step)
                step += 1
                time.sleep(0.02)
        say(done=step - 1)
    except Exception as exc:
        say(error=f"{type(exc).__name__}: {exc}")
        sys.exit(3)
    """
)


def _start(script, root, stop):
    return subprocess.Popen(
        [sys.executable, str(script), str(root), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_second_process_saving_into_the_same_root_is_refused(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root, stop_first, stop_second = tmp_path / "root", tmp_path / "stop1", tmp_path / "stop2"
    first = _start(script, root, stop_first)
    second = None
    try:
        line = first.stdout.readline()  # the first run has saved (and holds the root)
        assert json.loads(line) == {"saved": 0}, line + first.stderr.read()
        second = _start(script, root, stop_second)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 3, out + err
        error = json.loads(out.splitlines()[-1])["error"]
        assert error.startswith("CheckpointError: another run is saving checkpoints under")
        assert f"pid {first.pid} on host" in error
        assert "saved" not in out  # it wrote nothing
    finally:
        stop_first.touch()
        stop_second.touch()
        rest, err = first.communicate(timeout=120)
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
    assert first.returncode == 0, rest + err
    lines = [json.loads(x) for x in rest.splitlines()]
    assert "done" in lines[-1] and not any("error" in x for x in lines)
    last = lines[-1]["done"]
    assert sorted(os.listdir(root)) == [f"step_{last}"]  # keep=1, and the lease is gone
    assert find_latest_valid(root) == str(root / f"step_{last}")


def _plant(root, **record) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_NAME).write_text(json.dumps({"token": "someone-else", **record}))


def test_the_lease_of_a_process_that_is_gone_is_taken_over(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    root = tmp_path / "root"
    _plant(root, pid=int(gone.stdout), machine=_machine(), host="here", time=time.time())
    with CheckpointManager(root) as ckpt:
        assert ckpt.save(1, model=Net())
        assert json.loads((root / LEASE_NAME).read_text())["pid"] == os.getpid()
    assert sorted(os.listdir(root)) == ["step_1"]


def test_a_live_process_of_this_machine_holds_the_root(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        started = psutil.Process(sleeper.pid).create_time()
        root = tmp_path / "root"
        _plant(
            root,
            pid=sleeper.pid,
            started=started,
            machine=_machine(),
            host="here",
            since=time.time(),
            time=time.time(),
        )
        with CheckpointManager(root) as ckpt:
            with pytest.raises(CheckpointError, match=f"pid {sleeper.pid} on host here"):
                ckpt.save(1, model=Net())
        assert sorted(os.listdir(root)) == [LEASE_NAME]  # nothing written, their lease kept
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_manager_superseded_in_the_same_process_stops_saving(tmp_path):
    root = tmp_path / "root"
    old = CheckpointManager(root)
    old.save(1, model=Net())
    new = CheckpointManager(root)  # the cell was run again without closing the old one
    assert new.save(2, model=Net())
    with pytest.raises(CheckpointError, match="newer CheckpointManager of this process"):
        old.save(3, model=Net())
    old.close()
    assert (root / LEASE_NAME).exists()  # still the new one's
    new.close()
    assert sorted(os.listdir(root)) == ["step_1", "step_2"]
    restored = Net()
    assert CheckpointManager(root).restore(model=restored) == 3
    assert isinstance(restored.head.weight, torch.Tensor)
