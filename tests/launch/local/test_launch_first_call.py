"""A first call does not wait for the forkserver's preloads; later calls fork from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import json, os, time
    import multiprocessing.forkserver
    import multiprocessing.util

    import psutil

    import nbtools.launch
    from nbtools import distributed
    from nbtools.launch._local import _forkserver

    nbtools.launch.warm_up()  # what %load_ext nbtools does

    @distributed(processes=2, output="none")
    def where():
        import os, sys
        import torch.distributed as dist

        dist.barrier()
        return os.getppid(), "torch._dynamo" in sys.modules

    # The forkserver settles first, then imports torch and the rest: the call comes at
    # once, or once it has settled (WAIT_SETTLED).
    settled = os.path.join(multiprocessing.util.get_temp_dir(), "nbtools-forkserver-settled")
    while WAIT_SETTLED and not os.path.exists(settled):
        time.sleep(0.005)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    early_ready = _forkserver.ready()
    first = where.distributed()
    server_state = psutil.Process(server).status()
    while not _forkserver.ready():
        time.sleep(0.05)
    second = where.distributed()
    print(json.dumps({"me": os.getpid(), "server": server, "early_ready": early_ready,
                      "first": first, "second": second, "server_state": server_state}))
    """
)


@pytest.mark.parametrize("wait_settled", [True, False], ids=["settled", "at-once"])
def test_a_call_before_the_preloads_are_in_starts_fresh_ranks_and_later_calls_fork(
    tmp_path, wait_settled
):
    # Even a call made the moment the forkserver starts (a script's first line) does not
    # wait for its preloads: the forkserver settles in a fraction of a second, before torch.
    script = tmp_path / "first.py"
    script.write_text(f"WAIT_SETTLED = {wait_settled}\n" + _SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    out = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["early_ready"] is False
    # The first call's ranks are the caller's own children, started at once; they import
    # what they use (here not torch._dynamo, which the forkserver preloads).
    assert seen["first"] == [[seen["me"], False], [seen["me"], False]]
    # The forkserver, stopped while they imported, went on once their group had formed,
    assert seen["server_state"] != "stopped"
    # and the next call's ranks are forked from it, with everything preloaded.
    assert seen["second"] == [[seen["server"], True], [seen["server"], True]]


_LIBRARY_SCRIPT = textwrap.dedent(
    """
    import json, sys, time

    import mlflow  # the caller has imported a library its ranks take seconds to import

    import nbtools.launch
    from nbtools import distributed
    from nbtools.launch._local import _forkserver

    nbtools.launch.warm_up()

    @distributed(processes=2, output="none")
    def loaded():
        import sys

        return "mlflow" in sys.modules  # before the function imports anything

    while not _forkserver.ready():
        time.sleep(0.05)
    print(json.dumps(loaded.distributed()))
    """
)


def test_the_forkserver_preloads_the_heavy_libraries_the_caller_imported(tmp_path):
    script = tmp_path / "library.py"
    script.write_text(_LIBRARY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["MLFLOW_TRACKING_URI"] = (tmp_path / "mlruns").as_uri()
    out = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    # A rank forked from it finds the library loaded: a restarted rank does not import it again.
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True]
