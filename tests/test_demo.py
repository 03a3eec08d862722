"""The demo's building blocks in one process: sample files, decoding, and the checks it reports;
its figures as a browser draws them; and ``python -m nbtools demo`` itself, as a user runs it.

The multi-process run's checks are tests/integration/test_autorecovery.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

from nbtools._demo import (
    DecodedSamples,
    effective_history,
    exactly_once_problems,
    make_volume,
    run_demo,
    steps_per_epoch,
)
from nbtools._demo.samples import decode
from nbtools.data import DataLoader, VolumeDataset


def test_sample_files_decode_to_their_ids(tmp_path):
    paths = make_volume(tmp_path / "vol", 6)
    assert make_volume(tmp_path / "vol", 6) == paths  # idempotent
    ids, xs = [], []
    for path in paths:
        with open(path, "rb") as fh:
            sample_id, x, y = decode(fh.read())
        ids.append(int(sample_id))
        xs.append(x)
        assert x.shape == (16,) and y.shape == (1,)
    assert ids == list(range(6))
    assert not torch.equal(xs[0], xs[1])
    with pytest.raises(ValueError, match="bytes"):
        decode(b"short")


def test_decoded_samples_resume_through_the_loader_state(tmp_path):
    make_volume(tmp_path / "vol", 12)

    def loader():
        files = VolumeDataset(tmp_path / "vol", shuffle=True, seed=3, cache_dir=tmp_path / "cache")
        return DataLoader(DecodedSamples(files), batch_size=4, num_workers=0)

    first = loader()
    it = iter(first)
    seen = next(it)[0].tolist()
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    rest = [i for ids, _, _ in second for i in ids.tolist()]
    assert sorted(seen + rest) == list(range(12))


def test_steps_per_epoch_needs_full_batches():
    assert steps_per_epoch(128, 2, 8) == 8
    with pytest.raises(ValueError, match="multiple of 16"):
        steps_per_epoch(100, 2, 8)


def _write(path, records):
    with open(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def _rec(attempt, step, ids, rank=0, epoch=0):
    return {"attempt": attempt, "step": step, "epoch": epoch, "rank": rank, "ids": ids, "loss": 0.0}


def test_a_rerun_step_replaces_the_killed_attempts_record(tmp_path):
    _write(
        tmp_path / "rank0.jsonl",
        [_rec(0, 0, [0, 1]), _rec(0, 1, [2, 3]), _rec(1, 1, [2, 3]), _rec(1, 2, [4, 5])],
    )
    with open(tmp_path / "rank0.jsonl", "a") as fh:
        fh.write('{"attempt": 0, "st')  # cut short by the kill
    history = effective_history(str(tmp_path))
    assert sorted(history) == [(0, 0), (0, 1), (0, 2)]
    assert [history[(0, s)]["attempt"] for s in range(3)] == [0, 1, 1]
    assert exactly_once_problems(history, samples=6, steps=3, world_size=1) == []


def test_exactly_once_check_reports_duplicates_gaps_and_missing_steps(tmp_path):
    _write(tmp_path / "rank0.jsonl", [_rec(0, 0, [0, 1]), _rec(0, 1, [1, 3])])
    problems = exactly_once_problems(
        effective_history(str(tmp_path)), samples=4, steps=3, world_size=1
    )
    assert any("never ran" in p for p in problems)
    assert any("more than once" in p and "[1]" in p for p in problems)
    assert any("never seen" in p and "[2]" in p for p in problems)


def test_demo_refuses_a_directory_it_did_not_make(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert run_demo(str(tmp_path)) == 2
    assert "was not made by the demo" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


@pytest.mark.slow
def test_train_runs_in_process_and_continues_its_mlflow_run(tmp_path):
    from mlflow import MlflowClient

    from nbtools._demo import DemoConfig, loss_curve, train

    make_volume(tmp_path / "vol", 16)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = DemoConfig(
        volume=str(tmp_path / "vol"),
        run_dir=str(tmp_path / "run"),
        cache_dir=str(tmp_path / "cache"),
        tracking_uri=uri,
        epochs=1,
        every=2,
        verbose=False,
    )
    first = train(cfg)  # a plain call: one process, no group, 2 steps
    assert (first["restart"], first["restored_step"], first["steps"]) == (0, None, 2)
    # The first run ended normally, so its last step (1) was saved on close: nothing repeats.
    again = train(cfg.replace(epochs=2))
    assert again["restored_step"] == 1 and again["steps"] == 4
    assert again["run_id"] == first["run_id"]
    assert sorted(loss_curve(uri, first["run_id"])) == [0, 1, 2, 3]
    assert MlflowClient(tracking_uri=uri).get_run(first["run_id"]).info.status == "FINISHED"


def test_the_demo_writes_the_pane_timeline_of_its_run(tmp_path, clean_bus):
    pytest.importorskip("anywidget")
    from nbtools import events
    from nbtools._demo.cli import _MARKER, _close_pane, _open_pane

    (tmp_path / _MARKER).write_text("made by the demo")
    pane = _open_pane()  # as the demo does: this machine's GPUs (none here), not shown
    events.emit("phase", "run 1: killed and recovered")
    events.emit("checkpoint_saved", message="saved step_8", step=8, blocked_s=0.2)
    events.emit("rank_failed", message="rank 1 exited with SIGKILL (signal 9)", rank=1)
    events.emit("restart", message="restarting all 2 ranks (restart 1 of 2)", attempt=1)
    events.emit("checkpoint_restored", "restored step 12 from memory", step=12, seconds=0.1)
    events.emit("phase", "run 2: uninterrupted")
    path = _close_pane(pane, str(tmp_path / "timeline.html"))
    assert pane.status == "closed"
    assert path == str(tmp_path / "timeline.html")
    text = (tmp_path / "timeline.html").read_text()
    for kind in ("checkpoint_saved", "rank_failed", "restart", "checkpoint_restored"):
        assert kind in text
    assert "Plotly.newPlot" in text  # plotly.js inside: opens without a network
    figure = _figure_json(text)
    legend = {t.get("name") for t in figure["data"]}
    assert "checkpoint restore" in legend and "other event" not in legend  # drawn as a restore
    labels = [a["text"] for a in figure["layout"]["annotations"]]
    assert "run 1: killed and recovered" in labels and "run 2: uninterrupted" in labels
    assert "class='readings'" not in text  # no GPU here: no empty table of GPU readings


def _figure_json(page: str) -> dict:
    """The figure a plotly HTML page draws (its Plotly.newPlot call's data and layout)."""
    call = page[page.index("Plotly.newPlot(") :]
    decoder = json.JSONDecoder()
    rest = call[call.index("[") :]
    data, end = decoder.raw_decode(rest)
    layout, _ = decoder.raw_decode(rest[end:].lstrip(", \n"))
    return {"data": data, "layout": layout}


def test_the_recovery_line_comes_from_the_runs_events():
    from nbtools._demo.history import recovery_from_events
    from nbtools._demo.training import KILLED_KIND, RESUMED_KIND
    from nbtools.events import Event

    def event(at, kind, step=None, **fields):
        return Event(at, "node-a", 0, 1, kind, "", step, fields)

    run = [
        event(100.0, "checkpoint_saved", 12),
        event(101.0, KILLED_KIND, 13),
        event(101.1, "rank_failed"),
        event(101.6, "checkpoint_restored", 12, seconds=0.1, tier="memory"),
        event(102.4, RESUMED_KIND, 13),
    ]
    recovery = recovery_from_events(reversed(run))  # in any order
    assert recovery is not None
    assert recovery.line() == (
        "recovery: 1.4 s from the kill to the next step, 1 step trained again, restored from memory"
    )
    assert recovery_from_events(run[:3]) is None  # never restored: no line


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.browser
@pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Debian's chromium at {CHROMIUM}"
)
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright")
def test_the_recovery_figures_labels_cover_nothing_of_each_other(tmp_path):
    from playwright.sync_api import sync_playwright

    from nbtools._demo.figure import recovery_figure

    # The demo's curves: the loss falls from 0.56 to 0.06 over 24 steps.
    curve = {s: 0.06 + 0.5 * 0.88**s for s in range(24)}
    fig = recovery_figure(curve, curve, killed_at=13, restored_step=12, restored_tier="memory")
    fig.write_html(tmp_path / "recovery.html", include_plotlyjs=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 960, "height": 500})
            page.goto((tmp_path / "recovery.html").as_uri())
            page.wait_for_selector(".plotly-graph-div .main-svg", timeout=30_000)
            boxes = page.evaluate(
                "() => Array.from(document.querySelectorAll('.annotation, .legend'))"
                ".map((a) => { const r = a.getBoundingClientRect();"
                " return [a.textContent, r.left, r.top, r.right, r.bottom]; })"
            )
        finally:
            browser.close()
    texts = [b[0] for b in boxes]
    assert "rank SIGKILLed after step 13" in texts and "restored step 12 from memory" in texts
    assert "1 step trained again after the restore" in texts
    for i, (a, *ra) in enumerate(boxes):
        for b, *rb in boxes[i + 1 :]:
            apart = ra[2] <= rb[0] or rb[2] <= ra[0] or ra[3] <= rb[1] or rb[3] <= ra[1]
            assert apart, f"{a!r} {ra} covers {b!r} {rb}"


@pytest.mark.browser
@pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Debian's chromium at {CHROMIUM}"
)
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright")
def test_the_timelines_labels_cover_nothing_no_line_no_band_no_marker(tmp_path):
    from _demo_run import demo_events
    from playwright.sync_api import sync_playwright

    from nbtools.monitor.history import History
    from nbtools.monitor.report import write_html
    from nbtools.monitor.snapshot import PaneState
    from nbtools.monitor.timeline import drawn, encode, step_rates

    run = demo_events(time.time() - 60)  # the demo's events, as recorded
    path = write_html(
        tmp_path / "timeline.html",
        PaneState(
            History(capacity=10), [encode(e) for e in drawn(run)], {}, "NVML", rates=step_rates(run)
        ),
    )
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 960, "height": 700})
            page.goto(pathlib.Path(path).as_uri())
            page.wait_for_selector(".plotly-graph-div .main-svg", timeout=30_000)
            found = page.evaluate(
                "() => ['.annotation', '.legend', '.shapelayer path', '.scatterlayer .point']"
                ".map((s) => Array.from(document.querySelectorAll(s)).map((a) => {"
                " const r = a.getBoundingClientRect();"
                " return [a.textContent, r.left, r.top, r.right, r.bottom]; }))"
            )
        finally:
            browser.close()
    texts, legend, shapes, markers = found
    phases = [b for b in texts if b[0].startswith(("warm-up", "run 1", "run 2"))]
    assert [b[0] for b in phases] == [
        "warm-up: one epoch, discarded",
        "run 1: killed and recovered",
        "run 2: uninterrupted",
    ]
    assert len(shapes) > 10 and len(markers) > 20  # the saves' bands, the kill's line, ...
    boxes = texts + legend
    for i, (a, *ra) in enumerate(boxes):
        for b, *rb in boxes[i + 1 :] + (shapes + markers if a in {p[0] for p in phases} else []):
            apart = ra[2] <= rb[0] or rb[2] <= ra[0] or ra[3] <= rb[1] or rb[3] <= ra[1]
            assert apart, f"{a!r} {ra} covers {b or 'a line, band or marker'!r} {rb}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo_warms_up_then_says_what_the_recovery_took(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "nbtools", "demo", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("First one warm-up epoch, thrown away, so that neither run pays")
    recovery = [line for line in lines if line.startswith("recovery: ")]
    assert len(recovery) == 1, proc.stdout
    assert re.fullmatch(
        r"recovery: \d+\.\d s from the kill to the next step, \d+ steps? trained again, "
        r"restored from (memory|replica|volume)",
        recovery[0],
    ), recovery
    wall = next(line for line in lines if line.startswith("wall time:"))
    assert "s warm-up epoch: neither pays the cold start" in wall, wall
    assert lines[-1].startswith("OK: final parameters equal the uninterrupted run's")
    assert (out / "recovery.html").exists() and (out / "timeline.html").exists()
