"""How failures of ranks read in the caller."""

from __future__ import annotations

import signal

from nbtools.launch._failures import RankFailure, describe, from_exit, from_record


def test_killed_rank_names_the_signal():
    failure = from_exit(1, -int(signal.SIGKILL), attempt=2)
    assert failure.rank == 1 and failure.exitcode == -9 and failure.attempt == 2
    assert "SIGKILL" in failure.message


def test_exit_without_exception_says_so():
    assert "code 3" in from_exit(0, 3, attempt=0).message


def test_cause_comes_first_with_its_traceback():
    cause = from_record(
        {"rank": 1, "exc_type": "ValueError", "message": "bad", "traceback": "TB-1", "time": 5.0},
        attempt=0,
    )
    peer = from_record(
        {
            "rank": 0,
            "exc_type": "RuntimeError",
            "message": "closed",
            "traceback": "TB-0",
            "time": 6.0,
        },
        attempt=0,
    )
    text = describe({0: peer, 1: cause}, first=1, attempts=3)
    lines = text.splitlines()
    assert lines[0] == "rank 1 failed (after 3 attempts): ValueError: bad"
    assert lines[1] == "rank 0 also failed: RuntimeError: closed"
    assert "Traceback from rank 1:" in text and "TB-1" in text and "TB-0" not in text


def test_signal_failure_is_listed_without_traceback():
    killed = RankFailure(1, "Signal", "the process was killed by SIGKILL", exitcode=-9)
    assert describe({1: killed}, first=1) == "rank 1 failed: the process was killed by SIGKILL"
