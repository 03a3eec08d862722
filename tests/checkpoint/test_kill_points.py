"""SIGKILL a saving process at many points: the newest valid checkpoint always loads exactly.

One driver process imports torch once and forks a child per kill point. The
child arms a profiler hook that SIGKILLs it at the k-th call made by nbtools'
checkpoint code (in any thread), then saves. Points are spread from staging
through upload, verification and publishing to retention.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent(
    r"""
    import json, os, signal, sys, threading
    import torch
    torch.set_num_threads(1)
    from nbtools.checkpoint import CheckpointManager, find_latest_valid

    root, out = sys.argv[1], sys.argv[2]
    MARK = os.sep + os.path.join("nbtools", "checkpoint") + os.sep

    def objects(step):
        torch.manual_seed(step)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        return model, opt

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    def save_in_child(step, kill_at):
        # kill_at > 0: the kill_at-th call; kill_at <= 0: the (1 - kill_at)-th call after
        # publishing .metadata starts (the writer lease is published too, earlier).
        count = [0, -1]
        def hook(frame, event, arg):
            if event in ("call", "c_call") and MARK in frame.f_code.co_filename:
                count[0] += 1
                if (event == "call" and frame.f_code.co_name == "publish_bytes"
                        and frame.f_locals.get("rel") == ".metadata" and count[1] < 0):
                    count[1] = count[0]
                if count[0] == kill_at or (kill_at <= 0 and count[1] > 0 and count[0] == count[1] + 1 - kill_at):
                    os.kill(os.getpid(), signal.SIGKILL)
        model, opt = objects(step)
        threading.setprofile(hook)
        sys.setprofile(hook)
        with CheckpointManager(root, keep=2) as ckpt:
            ckpt.save(step, model=model, optimizer=opt)
        sys.setprofile(None)
        threading.setprofile(None)
        return count

    def run_child(step, kill_at):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                os.write(w, json.dumps(save_in_child(step, kill_at)).encode())
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        data = os.read(r, 1000)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        return status, json.loads(data) if data else None

    model, opt = objects(1)
    with CheckpointManager(root) as ckpt:
        ckpt.save(1, model=model, optimizer=opt)
    status, (total, publish_at) = run_child(2, 10**9)
    assert status == 0, status
    # 22 points spread over staging, upload and verification, then every call around publishing.
    points = sorted({1 + i * (publish_at - 2) // 21 for i in range(22)}) + [-d for d in range(0, 14)]
    results = []
    for i, kill_at in enumerate(points):
        step = 3 + i
        status, _ = run_child(step, kill_at)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert killed or (kill_at <= 0 and status == 0), (kill_at, status)
        latest = find_latest_valid(root)
        got = int(latest.rsplit("step_", 1)[1])
        model, opt = objects(got)
        fresh_model, fresh_opt = objects(999)
        start = CheckpointManager(root).restore(model=fresh_model, optimizer=fresh_opt)
        ok = start == got + 1 and same(model, fresh_model) and all(
            torch.equal(a, b)
            for sa, sb in zip(opt.state.values(), fresh_opt.state.values()) for a, b in zip(sa.values(), sb.values())
        )
        results.append({"kill_at": kill_at, "killed": killed, "step": step, "restored": got, "ok": ok})
    with open(out, "w") as fh:
        json.dump({"total": total, "publish_at": publish_at, "results": results}, fh)
    """
)


@pytest.mark.slow
def test_sigkill_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "root"), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    killed = [r for r in results if r["killed"]]
    assert len(killed) >= 20
    assert all(r["kill_at"] <= 0 for r in results if not r["killed"])  # only after publishing
    assert all(r["ok"] for r in results), results
    # Kills landed both before the publish (previous checkpoint used) and after it.
    assert any(r["restored"] == r["step"] for r in killed), results
    assert any(r["restored"] < r["step"] for r in killed), results
