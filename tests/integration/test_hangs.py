"""Hangs and stragglers of real gloo ranks, flagged by the kernel from their progress reports.

Timeouts are scaled through the options (``hang_timeout=``, the straggler
window variables), never by asserting how long anything took.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from nbtools import DistributedError, distributed, events

pytestmark = pytest.mark.slow


@pytest.fixture
def flags():
    """Every hang and straggler event published while the test runs."""
    seen: list[events.Event] = []
    lock = threading.Lock()

    def keep(batch):
        with lock:
            seen.extend(e for e in batch if e.kind in ("hang", "straggler"))

    events.subscribe(keep)
    yield seen
    events.unsubscribe(keep)


@pytest.fixture
def short_window(monkeypatch):
    monkeypatch.setenv("NBTOOLS_STRAGGLER_WINDOW_S", "8")
    monkeypatch.setenv("NBTOOLS_STRAGGLER_CONFIRM_S", "3")


def _opened(seen, kind):
    return [e for e in seen if e.kind == kind and not e.fields.get("ended")]


def _ended(seen, kind):
    return [e for e in seen if e.kind == kind and e.fields.get("ended")]


def test_a_stopped_rank_is_named_with_every_stack_and_the_flag_clears_after_sigcont(flags, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")
    resumed = []

    def resume(batch):
        for event in batch:
            if event.kind == "hang" and not event.fields.get("ended"):
                resumed.append(event.fields["rank_pid"])
                os.kill(event.fields["rank_pid"], signal.SIGCONT)

    @distributed(processes=3, hang_timeout=8)
    def train(steps):
        import time

        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            if dist.get_rank() == 1 and step == 20:
                os.kill(os.getpid(), signal.SIGSTOP)  # mid-step, before the all-reduce
            dist.all_reduce(t)
            events.step(step)
        return step

    events.subscribe(resume)
    try:
        assert train.distributed(40) == [39, 39, 39]
    finally:
        events.unsubscribe(resume)
    opened = _opened(flags, "hang")
    assert [e.rank for e in opened] == [1], opened  # the ranks waiting for it are not named
    assert opened[0].fields["node"] and opened[0].fields["since"] > 0
    assert [e.rank for e in _ended(flags, "hang")] == [1]
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hang:")]
    assert len(warnings) == 1, warnings
    text = warnings[0]
    assert "rank 1 on" in text and "stopped by a signal" in text and "Ranks 0, 2 wait" in text
    for rank in range(3):
        section = text.split(f"--- rank {rank}", 1)[1].split("\n--- rank", 1)[0]
        assert "in train" in section or "train (" in section, section  # its own Python stack


def test_a_rank_stuck_outside_a_collective_is_named_with_the_all_reduce_it_never_entered(
    flags, caplog, tmp_path
):
    caplog.set_level(logging.WARNING, logger="nbtools")
    release = tmp_path / "release"

    def on_hang(batch):
        if any(e.kind == "hang" and not e.fields.get("ended") for e in batch):
            release.touch()

    @distributed(processes=3, hang_timeout=8)
    def train(steps, release):
        import os
        import time

        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        for step in range(steps):
            dist.all_reduce(t)
            events.step(step)
            if dist.get_rank() == 1 and step == 20:
                while not os.path.exists(release):  # stuck in Python, outside any collective
                    time.sleep(0.05)
        return step

    events.subscribe(on_hang)
    try:
        assert train.distributed(30, str(release)) == [29, 29, 29]
    finally:
        events.unsubscribe(on_hang)
    opened = _opened(flags, "hang")
    assert [e.rank for e in opened] == [1], opened
    # Collective numbers count from the process group's own first one: read it from the text.
    assert opened[0].fields["collective"].startswith("all_reduce #")
    assert opened[0].fields["entered"] is False
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hang:")]
    assert len(warnings) == 1, warnings
    text = warnings[0].split("\n", 1)[0]
    seq = opened[0].fields["collective"].split("#")[1]
    assert f"ranks 0, 2 wait in all_reduce #{seq}, which rank 1 never entered" in text, text
    assert f"rank 1: #{int(seq) - 1}" in text, text


def test_a_rank_that_sleeps_in_its_step_is_the_only_straggler(flags, short_window):
    @distributed(processes=3)
    def train(steps):
        import random
        import time

        import torch
        import torch.distributed as dist

        rng = random.Random(dist.get_rank())
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        for step in range(steps):
            pause = 0.08 * rng.uniform(0.7, 1.3)
            time.sleep(pause * (2 if dist.get_rank() == 2 else 1))
            model(torch.randn(4, 8)).sum().backward()
            events.step(step)
        return step

    train.distributed(150)
    opened = _opened(flags, "straggler")
    assert {e.rank for e in opened} == {2}, opened
    assert all(e.fields["score"] < 0.75 and e.fields["since"] > 0 for e in opened)
    assert not _opened(flags, "hang")


def test_jitter_evaluation_pauses_saves_and_a_long_first_step_raise_no_flag(flags):
    # Default straggler settings: these are what must stay quiet on a healthy run.
    @distributed(processes=3, hang_timeout=6)
    def train(steps):
        import random
        import time

        import torch
        import torch.distributed as dist

        rng = random.Random(dist.get_rank())
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        for step in range(steps):
            if step == 1:
                time.sleep(9)  # a first step that compiles: every rank busy, none waiting
            time.sleep(0.08 * rng.uniform(0.7, 1.3))
            model(torch.randn(4, 8)).sum().backward()
            events.step(step)
            if step % 50 == 49:  # evaluation of a different length on each rank
                time.sleep(rng.uniform(1.0, 2.5))
                dist.barrier()
            if step % 30 == 29:
                time.sleep(0.6 if dist.get_rank() == 0 else 0.1)  # rank 0 writes the save
                events.emit("checkpoint_saved", step=step)
        return step

    assert train.distributed(160) == [159, 159, 159]
    assert flags == [], [e.message for e in flags]


def test_on_hang_restart_restarts_the_group_and_it_resumes_from_its_checkpoint(
    flags, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, hang_timeout=8, on_hang="restart", max_restarts=1)
    def train(root, steps):
        import time

        import torch
        import torch.distributed as dist

        from nbtools.checkpoint import CheckpointManager
        from nbtools.runtime import get_restart_count

        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        ckpt = CheckpointManager(root, every=5, async_save=False)
        start = ckpt.restore(model=model)
        for step in range(start, steps):
            time.sleep(0.05)
            if get_restart_count() == 0 and dist.get_rank() == 1 and step == 12:
                os.kill(os.getpid(), signal.SIGSTOP)
            model(torch.ones(2, 4)).sum().backward()
            ckpt.maybe_save(step, model=model)
            events.step(step)
        ckpt.close()
        return start, get_restart_count()

    results = train.distributed(str(tmp_path / "ckpt"), 20)
    assert results[0] == results[1]
    start, restarts = results[0]
    assert restarts == 1 and 0 < start <= 12
    assert [e.rank for e in _opened(flags, "hang")] == [1]


@pytest.mark.parametrize(("library", "steps"), [("hf", 5), ("pl", 7)])
def test_hf_and_lightning_trainers_report_their_steps_through_their_callbacks(library, steps):
    import importlib.util
    import subprocess
    import sys

    module = {"hf": "transformers", "pl": "lightning"}[library]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    script = os.path.join(os.path.dirname(__file__), "_trainer_steps.py")
    out = subprocess.run(
        [sys.executable, script, library], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"PROGRESS {steps} {steps}" in out.stdout  # one report per optimizer step


def _hang_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("hang:")]


def _long_phase_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "in a long phase" in r.getMessage()]


def test_a_rank_whose_clock_is_a_minute_behind_raises_no_flag(flags):
    # Default settings: a bound of 45 s, which the rank's clock alone would exceed.
    @distributed(processes=2)
    def train(steps):
        import time

        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:  # this rank's clock reads a minute behind the kernel's
            from nbtools.events import _emit, _progress

            _emit._time = _progress._time = lambda: time.time() - 60
        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            dist.all_reduce(t)
            events.step(step)
        return step

    assert train.distributed(120) == [119, 119]
    assert flags == [], [e.message for e in flags]


def test_rank_zero_evaluating_while_rank_one_waits_is_one_line_not_a_hang(flags, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, hang_timeout=8)
    def train(steps):
        import time

        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            dist.all_reduce(t)
            events.step(step)
            if step == 20:
                if dist.get_rank() == 0:  # evaluate on rank 0 only: busy outside collectives
                    end = time.monotonic() + 15
                    while time.monotonic() < end:
                        torch.randn(64, 64) @ torch.randn(64, 64)
                dist.barrier()
        return step

    assert train.distributed(30) == [29, 29]
    assert not _opened(flags, "hang"), [e.message for e in flags]
    assert _hang_warnings(caplog) == []
    (line,) = _long_phase_lines(caplog)
    assert line.startswith("rank 0 on ") and "outside collectives (busy " in line, line


def test_a_phase_the_rank_names_is_not_a_hang_and_not_a_line(flags, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, hang_timeout=8)
    def train(steps):
        import time

        import torch
        import torch.distributed as dist

        @events.phase("evaluate")
        def evaluate():
            time.sleep(14)  # idle, as a wait on a remote service: named, so not a hang

        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            dist.all_reduce(t)
            events.step(step)
            if step == 20:
                if dist.get_rank() == 0:
                    evaluate()
                dist.barrier()
        return step

    assert train.distributed(30) == [29, 29]
    assert flags == [], [e.message for e in flags]
    assert _long_phase_lines(caplog) == []


def test_a_busy_rank_that_stops_using_the_cpu_is_named_alone(flags, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="nbtools")
    release = tmp_path / "release"

    def on_hang(batch):
        if any(e.kind == "hang" and not e.fields.get("ended") for e in batch):
            release.touch()

    @distributed(processes=2, hang_timeout=8)
    def train(steps, release):
        import os
        import time

        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            dist.all_reduce(t)
            events.step(step)
            if step == 20 and dist.get_rank() == 0:
                end = time.monotonic() + 12
                while time.monotonic() < end:  # busy first...
                    torch.randn(64, 64) @ torch.randn(64, 64)
                while not os.path.exists(release):  # ...then stuck, using no CPU
                    time.sleep(0.2)
        return step

    events.subscribe(on_hang)
    try:
        assert train.distributed(30, str(release)) == [29, 29]
    finally:
        events.unsubscribe(on_hang)
    assert [e.rank for e in _opened(flags, "hang")] == [0], [e.message for e in flags]
    assert len(_long_phase_lines(caplog)) == 1


def test_a_rank_blocked_on_its_own_lock_is_named_not_the_rank_waiting_for_it(flags, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, hang_timeout=8)
    def train(steps):
        import threading
        import time

        import torch
        import torch.distributed as dist

        lock = threading.Lock()
        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            if step == 20 and dist.get_rank() == 1:
                with lock:
                    lock.acquire(timeout=20)  # blocked in futex, as a wait in gloo is
            dist.all_reduce(t)
            events.step(step)
        return step

    assert train.distributed(30) == [29, 29]
    assert [e.rank for e in _opened(flags, "hang")] == [1], [e.message for e in flags]
    (text,) = _hang_warnings(caplog)
    assert "rank 0 waits in all_reduce #" in text and "which rank 1 never entered" in text


def test_ranks_in_different_collectives_are_named_as_a_mismatch(flags, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, hang_timeout=8, on_hang="restart", max_restarts=0)
    def train(steps):
        import time

        import torch
        import torch.distributed as dist

        t = torch.ones(1024)
        for step in range(steps):
            time.sleep(0.05)
            if step == 20:
                if dist.get_rank() == 0:
                    dist.all_reduce(t)
                else:
                    dist.broadcast(t, src=1)
            else:
                dist.all_reduce(t)
            events.step(step)
        return step

    with pytest.raises(DistributedError):
        train.distributed(30)
    assert sorted(e.rank for e in _opened(flags, "hang")) == [0, 1]
    (text,) = _hang_warnings(caplog)
    assert "rank 0 is in all_reduce #" in text and "(4 KB), rank 1 in broadcast #" in text
    assert ": a mismatched collective" in text


_SCRIPT = textwrap.dedent(
    """
    import threading
    import time

    from nbtools import DistributedError, distributed, events


    @distributed(processes=2, hang_timeout=8, on_hang="restart", max_restarts=0)
    def train(steps):
        import torch
        import torch.distributed as dist

        lock = threading.Lock()
        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            if step == 10 and dist.get_rank() == 1:
                with lock:
                    lock.acquire(timeout=60)  # the line the report points at
            dist.all_reduce(t)
            events.step(step)


    try:
        train.distributed(20)
    except DistributedError:
        pass
    """
)


def test_the_stack_of_a_function_sent_from_a_script_shows_its_file_line_and_text(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = out.stderr.split("hang: ", 1)[1]
    section = report.split("--- rank 1", 1)[1].split("--- rank", 1)[0]
    line = (
        _SCRIPT.splitlines().index(
            "                lock.acquire(timeout=60)  # the line the report points at"
        )
        + 1
    )
    assert f'File "{script}", line {line}, in train' in section, section
    assert "lock.acquire(timeout=60)  # the line the report points at" in section, section
    assert "<dynamic-code>" not in report


def test_a_long_save_through_the_manager_is_not_a_hang(flags, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="nbtools")

    @distributed(processes=2, hang_timeout=3)
    def train(root, steps):
        import time

        import fsspec
        import torch
        import torch.distributed as dist
        from fsspec.implementations.local import LocalFileSystem

        from nbtools.checkpoint import CheckpointManager

        slowed = []

        class SlowMount(LocalFileSystem):
            """A mount of a remote volume where rank 0's first upload takes 12 s."""

            protocol = "nbtslow"

            @classmethod
            def _strip_protocol(cls, path):
                return super()._strip_protocol(str(path).removeprefix("nbtslow://"))

            def put_file(self, lpath, rpath, **kwargs):
                if dist.get_rank() == 0 and not slowed:
                    slowed.append(rpath)
                    time.sleep(12)  # idle: waiting on the remote end, using no CPU
                return super().put_file(lpath, rpath, **kwargs)

        fsspec.register_implementation("nbtslow", SlowMount, clobber=True)
        model = torch.nn.Linear(64, 64)
        ckpt = CheckpointManager(f"nbtslow://{root}", every=10)
        t = torch.ones(1)
        for step in range(steps):
            time.sleep(0.05)
            dist.all_reduce(t)
            ckpt.maybe_save(step, model=model)
        ckpt.close()
        return bool(slowed), ckpt.last_saved_step

    assert train.distributed(str(tmp_path / "ckpt"), 25) == [(True, 24), (False, 24)]
    assert flags == [], [e.message for e in flags]
    assert _hang_warnings(caplog) == []


_CELL = """\
import threading
import time

from nbtools import distributed, events


@distributed(processes=2, hang_timeout=5)
def train(steps):
    import torch
    import torch.distributed as dist

    lock = threading.Lock()
    t = torch.ones(1)
    for step in range(steps):
        time.sleep(0.05)
        if step == 10 and dist.get_rank() == 1:
            with lock:
                lock.acquire(timeout=20)  # the line the report points at
        dist.all_reduce(t)
        events.step(step)
    return step


train.distributed(15)
"""


@pytest.mark.kernel
def test_the_stack_of_a_hung_cell_function_names_the_cell_as_ipython_does(tmp_path):
    from _user_code_nb import NotebookKernel

    with NotebookKernel(tmp_path) as kernel:
        text = kernel.run(_CELL)
        number = kernel.nb.cells[-1].execution_count
    assert "[14, 14]" in text, text
    report = text.split("hang: ", 1)[1]
    section = report.split("--- rank 1", 1)[1].split("--- rank", 1)[0]
    line = (
        _CELL.splitlines().index(
            "                lock.acquire(timeout=20)  # the line the report points at"
        )
        + 1
    )
    assert f"Cell In[{number}], line {line}, in train" in section, section
    assert "lock.acquire(timeout=20)  # the line the report points at" in section, section
    assert "<dynamic-code>" not in report
