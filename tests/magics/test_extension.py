"""``%load_ext nbtools`` / ``%unload_ext nbtools``."""

from __future__ import annotations

import pytest


def test_load_registers_the_magics_and_unload_removes_them(ip):
    magics = ip.magics_manager.magics
    assert "gpu_pane" in magics["line"] and "autoresume" in magics["cell"]
    ip.run_line_magic("unload_ext", "nbtools")
    assert "gpu_pane" not in magics["line"] and "autoresume" not in magics["cell"]
    assert "distributed" not in magics["line"] and "distributed" not in magics["cell"]
    assert "NbtoolsMagics" not in ip.magics_manager.registry
    assert "DistributedMagics" not in ip.magics_manager.registry
    ip.run_line_magic("load_ext", "nbtools")
    assert "gpu_pane" in magics["line"] and "autoresume" in magics["cell"]


def test_the_magics_document_their_arguments(ip):
    doc = ip.magics_manager.magics["cell"]["autoresume"].__doc__
    for option in ("ROOT", "--every", "--keep", "--state", "--mlflow", "--run-name"):
        assert option in doc
    assert "--simulated" in ip.magics_manager.magics["line"]["gpu_pane"].__doc__
    assert "--cluster" in ip.magics_manager.magics["line"]["gpu_pane"].__doc__


def test_unloading_the_extension_stops_the_ranks_it_started(ip):
    import psutil

    ip.run_line_magic("distributed", "start --processes 2")
    ranks = ip.magics_manager.registry["DistributedMagics"].pool
    pids = list(ranks.pids)
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    ip.run_line_magic("unload_ext", "nbtools")
    assert ranks.closed
    gone = [p for p in pids if not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie"]
    assert gone == pids
    ip.run_line_magic("load_ext", "nbtools")


def test_a_trailing_comment_is_dropped_as_a_shell_drops_it():
    from nbtools._magics import strip_comment

    assert strip_comment("start --processes 2     # or --gpus 8, --cluster ray") == (
        "start --processes 2"
    )
    assert strip_comment("   # runs on every rank") == ""
    assert strip_comment("/data/run#3 --every 3") == "/data/run#3 --every 3"  # inside a word
    assert strip_comment('"/data/a # b" --every 2  # c') == '"/data/a # b" --every 2'
    assert strip_comment("pull 'x") == "pull 'x"  # unbalanced: left for the parser to report


def test_the_line_magics_ignore_a_trailing_comment(ip, capsys):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="no pool is running"):
        ip.run_cell_magic("distributed", "  # runs on every rank", "x = 1")
    ip.run_line_magic("distributed", "stop   # nothing to stop")
    assert "distributed: no pool is running" in capsys.readouterr().out
    ip.run_line_magic("gpu_pane", "--close  # closes nothing")
