"""An interrupt that reaches a rank before the command it is for began there still stops it.

The kernel sends a command, then, at Ctrl+C, an interrupt for it. A rank busy
elsewhere (a slow machine, a rank still finishing the previous reply) may read
the interrupt before it begins the command; the interrupt must not be lost, or the
command runs to its end while the kernel gives up on the rank and replaces the pool.
These tests talk to a real rank process over the pool's own channel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nbtools.launch.pool._channel import Listener, wait_readable

_RANK = """
import sys, threading
from nbtools.launch.pool._rank import serve
address, key = sys.argv[1], bytes.fromhex(sys.stdin.readline().strip())
if sys.argv[2] == "thread":  # as on ray: the rank serves from a thread that is not the main one
    server = threading.Thread(target=serve, args=(address, key, False))
    server.start()
    server.join()
else:
    serve(address, key, False)
"""


def _replies(link, wanted: int, deadline: float) -> dict[int, str]:
    got: dict[int, str] = {}
    while len(got) < wanted and time.monotonic() < deadline:
        wait_readable([link], None, 0.1)
        for message in link.frames():
            got[message[0]] = message[1]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("serving", ["main", "thread"])
def test_an_interrupt_read_before_its_command_began_stops_that_command(tmp_path, serving):
    listener = Listener(1, directory=str(tmp_path))
    go = tmp_path / "go"
    env = dict(os.environ, RANK="0")
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(listener.address), serving],
        stdin=subprocess.PIPE,
        env=env,
        text=True,
    )
    link = None
    try:
        assert proc.stdin is not None
        proc.stdin.write(listener.key.hex() + "\n")
        proc.stdin.close()
        while link is None:
            assert proc.poll() is None, "the rank process ended before it connected"
            wait_readable([], listener, 0.1)
            admitted = listener.poll()
            if admitted:
                link = admitted[0][0]
        # Command 1 keeps the rank busy until the test says go; command 2 and its
        # interrupt arrive meanwhile, so the rank reads the interrupt before it begins 2.
        wait_go = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)"
        link.send((1, "exec", (wait_go, "<cell 1>", "none"), None))
        link.send((2, "exec", ("import time\ntime.sleep(600)", "<cell 2>", "none"), None))
        link.send((2, "interrupt", None))
        link.send((3, "exec", ("x = 6 * 7", "<cell 3>", "none"), None))
        go.write_text("go")
        replies = _replies(link, 3, time.monotonic() + 120)
        assert replies == {1: "ok", 2: "interrupted", 3: "ok"}, replies
        link.send((4, "stop", None))
        assert _replies(link, 1, time.monotonic() + 60) == {4: "ok"}
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if link is not None:
            link.close()
        listener.close()
