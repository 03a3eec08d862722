"""Retention against a concurrent reader: a restore never loses its checkpoint to ``keep``.

A second process restores in a loop while a writer saves every step with
``keep=1``, so retention deletes each checkpoint about as soon as the next one is
published, often while the reader is reading it. Every restore must still load
a whole checkpoint (the newer one when its own was deleted).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

# Saves every step with keep=1, each checkpoint's weights all equal to its step, until told to stop.
WRITER = textwrap.dedent(
    r"""
    import os, sys, time
    import torch
    torch.set_num_threads(1)
    from nbtools.checkpoint import CheckpointManager

    root, stop = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(256, 256)
    with CheckpointManager(root, every=1, keep=1, save_on_close=False) as ckpt:
        step = 0
        while not os.path.exists(stop) and step < 100000:
            with torch.no_grad():
                model.weight.fill_(float(step))
                model.bias.fill_(float(step))
            ckpt.maybe_save(step, model=model)
            ckpt.wait()
            if step == 0:
                print("saved", flush=True)
            step += 1
    print("done", step, flush=True)
    """
)

# Restores ``tries`` times; reports each failure, and a restore of nothing or of a mix.
READER = textwrap.dedent(
    r"""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from nbtools.checkpoint import CheckpointManager

    root, tries = sys.argv[1], int(sys.argv[2])
    failures, steps = [], set()
    for _ in range(tries):
        model = torch.nn.Linear(256, 256)
        try:
            start = CheckpointManager(root).restore(model=model)
        except BaseException as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        if start == 0:
            failures.append("restore found no checkpoint")
            continue
        steps.add(start - 1)
        want = float(start - 1)
        if not (torch.all(model.weight == want) and torch.all(model.bias == want)):
            failures.append(f"step {start - 1} restored other values")
    print(json.dumps({"failures": failures, "steps": len(steps)}), flush=True)
    """
)


def test_a_restore_while_keep_1_deletes_checkpoints_never_fails(tmp_path):
    writer_py, reader_py = tmp_path / "writer.py", tmp_path / "reader.py"
    writer_py.write_text(WRITER)
    reader_py.write_text(READER)
    root, stop = tmp_path / "root", tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, str(writer_py), str(root), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = writer.stdout.readline()
        assert first == "saved\n", first + writer.stderr.read()
        reader = subprocess.run(
            [sys.executable, str(reader_py), str(root), "60"],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, out + err
    assert reader.returncode == 0, reader.stdout + reader.stderr
    report = json.loads(reader.stdout.splitlines()[-1])
    saved = int(out.split()[-1])
    assert report["failures"] == [], f"{len(report['failures'])} of 60 failed"
    # The writer went on saving (and deleting) while the reader read: they overlapped.
    assert saved > 10 and report["steps"] > 1, (saved, report)
