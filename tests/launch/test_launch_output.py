"""Forwarding rank output line by line with a rank prefix."""

from __future__ import annotations

import io
import re

import pytest

from nbtools.launch import _output
from nbtools.launch._output import OutputForwarder


def _files(tmp_path, ranks=2):
    outs = {r: str(tmp_path / f"out{r}") for r in range(ranks)}
    errs = {r: str(tmp_path / f"err{r}") for r in range(ranks)}
    return outs, errs


def test_every_line_gets_its_rank_prefix(tmp_path):
    outs, errs = _files(tmp_path)
    stdout, stderr = io.StringIO(), io.StringIO()
    forwarder = OutputForwarder(outs, errs, "all", stdout, stderr).start()
    with open(outs[0], "w") as fh:
        fh.write("one\ntwo\n")
    with open(outs[1], "w") as fh:
        fh.write("half a li")
    with open(errs[1], "w") as fh:
        fh.write("warning\n")
    forwarder.stop()
    forwarder.stop()  # idempotent
    assert stdout.getvalue().count("[rank 0] ") == 2
    assert "[rank 0] one\n[rank 0] two\n" in stdout.getvalue()
    assert "[rank 1] half a li\n" in stdout.getvalue()  # a trailing partial line is not lost
    assert stderr.getvalue() == "[rank 1] warning\n"


def test_carriage_returns_end_lines_for_progress_bars(tmp_path):
    outs, errs = _files(tmp_path, ranks=1)
    stdout = io.StringIO()
    forwarder = OutputForwarder(outs, errs, "all", stdout, io.StringIO()).start()
    with open(outs[0], "w") as fh:
        fh.write("10%\r20%\r")
    forwarder.stop()
    assert stdout.getvalue() == "\r[rank 0] 10%\r[rank 0] 20%"


def test_rank0_and_none_modes(tmp_path):
    outs, errs = _files(tmp_path)
    for path in outs.values():
        with open(path, "w") as fh:
            fh.write("hi\n")
    only0, nothing = io.StringIO(), io.StringIO()
    OutputForwarder(outs, errs, "rank0", only0, io.StringIO()).start().stop()
    OutputForwarder(outs, errs, "none", nothing, io.StringIO()).start().stop()
    assert only0.getvalue() == "[rank 0] hi\n"
    assert nothing.getvalue() == ""


def _jupyter(text: str) -> str:
    """What a notebook shows for a stream's text: a carriage return rewrites its line."""
    return re.sub(r"[^\n]*\r(?=[^\n])", "", text).replace("\r", "")


class _Ranks:
    """Each rank's stderr log file, appended to in steps, forwarded by polls in between."""

    def __init__(self, tmp_path, ranks=2, mode="all"):
        outs, errs = _files(tmp_path, ranks)
        self.errs = errs
        for path in list(outs.values()) + list(errs.values()):
            open(path, "w").close()
        self.stderr = io.StringIO()
        self.forwarder = OutputForwarder(outs, errs, mode, io.StringIO(), self.stderr)

    def write(self, rank: int, text: str) -> None:
        with open(self.errs[rank], "a") as fh:
            fh.write(text)
        self.forwarder.poll()
        self.forwarder.poll()


def _bar_steps(label: str, steps: int) -> list[str]:
    # What tqdm writes to a file: "\r" + state at each update, "\n" at close.
    parts = [f"\r{label} {100 * i // steps:3d}%|" for i in range(steps + 1)]
    parts[-1] += "\n"
    return parts


def test_only_rank0_progress_updates_are_shown_and_every_final_line_prints(tmp_path):
    ranks = _Ranks(tmp_path)
    for part0, part1 in zip(_bar_steps("epoch", 4), _bar_steps("epoch", 4), strict=True):
        ranks.write(0, part0)
        ranks.write(1, part1)
    ranks.write(1, "saved\n")
    ranks.forwarder.poll(final=True)
    raw = ranks.stderr.getvalue()
    assert "\r[rank 0] epoch  50%|" in raw  # rank 0's bar updates live
    assert "[rank 1] epoch  50%" not in raw  # rank 1's updates would overwrite it
    assert _jupyter(raw).splitlines() == [
        "[rank 0] epoch 100%|",
        "[rank 1] epoch 100%|",
        "[rank 1] saved",
    ]


def test_a_line_printed_while_rank0s_bar_runs_goes_above_the_bar(tmp_path):
    ranks = _Ranks(tmp_path)
    ranks.write(0, "\rtrain  10%|")
    ranks.write(1, "checkpoint saved\n")
    assert _jupyter(ranks.stderr.getvalue()) == "[rank 1] checkpoint saved\n[rank 0] train  10%|"
    ranks.write(0, "\rtrain 100%|\n")
    ranks.forwarder.poll(final=True)
    assert _jupyter(ranks.stderr.getvalue()).splitlines() == [
        "[rank 1] checkpoint saved",
        "[rank 0] train 100%|",
    ]


def test_a_positioned_bar_written_in_pieces_over_many_polls_leaves_no_stray_line(
    tmp_path, monkeypatch
):
    # tqdm draws a bar at position=1 in three writes (newline, bar, cursor-up); a busy rank
    # can be paused between them for several of the forwarder's polls.
    monkeypatch.setattr(_output, "_HOLD_S", 60.0)  # however slow this machine is
    ranks = _Ranks(tmp_path)
    ranks.write(0, "\repoch   0%|")
    for piece in ("\n", "\reval  67%|", "\x1b[A"):
        ranks.write(0, piece)
        for _ in range(3):
            ranks.forwarder.poll()
    ranks.write(0, "\repoch 100%|\n")
    ranks.forwarder.poll(final=True)
    assert _jupyter(ranks.stderr.getvalue()).splitlines() == ["[rank 0] epoch 100%|"]


def test_torch_rank_prefix_is_replaced_not_doubled(tmp_path):
    ranks = _Ranks(tmp_path)
    ranks.write(1, "[rank1]:[W1020 12:00:00] a warning from c10d\n")
    ranks.write(0, "[rank1]: quoted from another rank\n")
    ranks.forwarder.poll(final=True)
    assert ranks.stderr.getvalue().splitlines() == [
        "[rank 1] [W1020 12:00:00] a warning from c10d",
        "[rank 0] [rank1]: quoted from another rank",
    ]


def test_real_nested_tqdm_bars_keep_other_ranks_lines_intact(tmp_path):
    tqdm = pytest.importorskip("tqdm").tqdm
    ranks = _Ranks(tmp_path)
    files = {r: open(ranks.errs[r], "a") for r in (0, 1)}
    try:
        outer = {r: tqdm(total=2, desc="epoch", file=files[r], mininterval=0) for r in (0, 1)}
        for _ in range(2):
            for r in (0, 1):  # position=1: newlines, the bar, then cursor-up escapes
                with tqdm(
                    total=2, desc="eval", position=1, leave=False, file=files[r], mininterval=0
                ) as inner:
                    inner.update(2)
                files[r].write("\x1b[32mgreen\x1b[0m\n")
                files[r].flush()
                ranks.forwarder.poll()
                outer[r].update()
                files[r].flush()
                ranks.forwarder.poll()
        for r in (0, 1):
            outer[r].close()
    finally:
        for fh in files.values():
            fh.close()
    ranks.forwarder.poll(final=True)
    raw = ranks.stderr.getvalue()
    assert "\x1b[A" not in raw and "\x1b[32mgreen" in raw  # cursor moves go, colours stay
    lines = _jupyter(raw).splitlines()
    assert all(re.match(r"\[rank [01]\] (?!\[rank)", line) for line in lines), lines
    assert [line for line in lines if "green" in line] == [
        "[rank 0] \x1b[32mgreen\x1b[0m",
        "[rank 1] \x1b[32mgreen\x1b[0m",
    ] * 2
    finals = [line for line in lines if "epoch" in line]
    assert len(finals) == 2 and all("100%" in line for line in finals), lines
    assert not [line for line in lines if "eval" in line], lines  # leave=False bars vanish


DUMP_SCRIPT = """
import faulthandler, sys, threading, time

def user_loop(stop):      # the user's thread: its frame is kept
    while not stop.wait(0.01):
        pass

stop = threading.Event()
threading.Thread(target=user_loop, args=(stop,), name="user").start()
for _ in range(3):        # library threads: folded
    threading.Thread(target=threading.Event().wait, args=(5,), daemon=True).start()
time.sleep(0.2)
faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
stop.set()
"""


def test_a_stack_dump_is_folded_to_user_frames_and_kept_whole(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text(DUMP_SCRIPT)
    dump = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    ).stderr
    assert dump.count("(most recent call first)") == 5, dump  # a real faulthandler dump

    outs, errs = _files(tmp_path, ranks=1)
    stderr = io.StringIO()
    forwarder = OutputForwarder(outs, errs, "all", io.StringIO(), stderr).start()
    with open(errs[0], "w") as fh:
        fh.write(dump + "after the dump\n")
    forwarder.stop()
    shown = stderr.getvalue().splitlines()
    assert all(line.startswith("[rank 0] ") for line in shown)
    assert any("user_script.py" in line and "in user_loop" in line for line in shown), shown
    assert not any("in _bootstrap" in line for line in shown), shown  # library frames folded
    assert any("threading.py" in line and "in wait" in line for line in shown)  # where it waits
    assert (
        shown[-2]
        == "[rank 0] +3 threads of nbtools and libraries (the whole dump: the exception's .stacks)"
    )
    assert shown[-1] == "[rank 0] after the dump"
    assert len(shown) < 12
    assert forwarder.stacks[0].count("(most recent call first)") == 5  # kept in full
    assert "threading.py" in forwarder.stacks[0]
