"""``%load_ext nbtools`` / ``%unload_ext nbtools``."""

from __future__ import annotations


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
