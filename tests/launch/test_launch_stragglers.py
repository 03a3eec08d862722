"""A straggler is told where the launch's output goes: one line when flagged, one when over."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import time
    from nbtools import distributed

    @distributed(processes=2)
    def train():
        import torch
        import torch.distributed as dist
        from nbtools import events

        t = torch.ones(1)
        start = time.monotonic()
        step = 0
        while t.item() > 0:
            # Rank 1 computes ten times longer per step for 8 s; rank 0 waits for it.
            slow = dist.get_rank() == 1 and time.monotonic() - start < 8
            end = time.monotonic() + (0.1 if slow else 0.01)
            while time.monotonic() < end:
                pass
            # Both ranks go on until one has trained for 14 s: they agree on every step.
            t.fill_(1.0 if time.monotonic() - start < 14 else 0.0)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            step += 1
            events.step(step)

    train.distributed()
    """
)


def test_a_straggler_flag_prints_one_line_when_it_starts_and_one_when_it_ends(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, NBTOOLS_STRAGGLER_WINDOW_S="3", NBTOOLS_STRAGGLER_CONFIRM_S="1")
    out = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "straggler" in line]
    started = [line for line in lines if " is a straggler since " in line]
    ended = [line for line in lines if "straggler flag over after" in line]
    assert len(started) == 1 and len(ended) == 1, out.stderr
    # What was measured: time outside collectives, the flagged rank's against the median's.
    assert started[0].startswith("nbtools: WARNING: rank 1 on "), started
    assert "% of its time outside collectives against the median rank's " in started[0]
    assert "(score 0." in started[0] and "flagged under 0.75)" in started[0]
    assert ended[0].startswith("nbtools: WARNING: rank 1 on "), ended
    assert "median step rate" not in out.stderr
