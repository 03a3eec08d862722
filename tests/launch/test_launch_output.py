"""Forwarding rank output line by line with a rank prefix."""

from __future__ import annotations

import io

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
    assert stdout.getvalue() == "[rank 0] 10%\r[rank 0] 20%\r"


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
