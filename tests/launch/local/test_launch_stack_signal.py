"""The stacks of quiet ranks are asked for only from ranks that can answer.

SIGUSR2 kills a process that has no handler for it: a rank still starting (its
interpreter importing torch) must not get it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from nbtools.launch._local._elastic import catches


def _started(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_only_a_process_with_a_stack_handler_is_asked_for_its_stacks():
    bare = _started("import time; print('ready', flush=True); time.sleep(60)")
    handled = _started(
        "import faulthandler, signal, time\n"
        "faulthandler.register(signal.SIGUSR2)\n"
        "print('ready', flush=True); time.sleep(60)"
    )
    try:
        assert not catches(bare.pid, signal.SIGUSR2)
        assert catches(handled.pid, signal.SIGUSR2)
        handled.send_signal(signal.SIGUSR2)  # answers with its stacks and lives on
        time.sleep(0.5)
        assert handled.poll() is None
    finally:
        for proc in (bare, handled):
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    assert not catches(bare.pid, signal.SIGUSR2)  # gone: nothing to ask
