"""How failures of ranks read in the caller."""

from __future__ import annotations

import signal

from nbtools.launch._failures import (
    MESSAGE_LIMIT,
    TRACEBACK_LIMIT,
    RankFailure,
    describe,
    from_early_exit,
    from_exit,
    from_record,
)


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


def test_early_exit_reads_as_such():
    text = describe({1: from_early_exit(1, attempt=0)}, first=1, attempts=2)
    assert text == "rank 1 exited with code 0 before returning (after 2 attempts)"


def test_a_peer_that_returned_explains_a_failure_in_a_collective():
    lost = from_record(
        {
            "rank": 0,
            "exc_type": "RuntimeError",
            "message": "Connection closed by peer",
            "traceback": "TB",
            "time": 1.0,
            "collective": "all_reduce",
        },
        attempt=0,
    )
    text = describe({0: lost}, first=0, returned=frozenset({1}))
    assert text.splitlines()[0] == (
        "rank 1 returned while rank 0 was in all_reduce, so rank 0 failed: "
        "RuntimeError: Connection closed by peer"
    )
    assert describe({0: lost}, first=0).startswith("rank 0 failed: RuntimeError")


def test_huge_messages_and_tracebacks_are_cut_in_the_text_only():
    message = "m" * 3_000_000
    failure = from_record(
        {
            "rank": 2,
            "exc_type": "ValueError",
            "message": message,
            "traceback": "Traceback:\n" + "  frame\n" * 50_000 + f"ValueError: {message}\n",
        },
        attempt=0,
    )
    text = describe({2: failure}, first=2)
    assert len(text) < 2 * (MESSAGE_LIMIT + TRACEBACK_LIMIT)
    assert "failures[2].message" in text and "failures[2].traceback" in text
    assert failure.message == message and failure.traceback.endswith(message + "\n")


def test_one_regroup_loop_forms_a_group_again_only_while_no_user_code_ran():
    # The loop a plain call's attempts and a pool's generations both start through.
    from nbtools.launch._backend import Failed, Finished
    from nbtools.launch._failures import REGROUPS
    from nbtools.launch._rank import GROUP_PHASE
    from nbtools.launch._runner import until_formed

    unformed = Failed({0: RankFailure(0, "DistStoreError", "timed out", phase=GROUP_PHASE)}, 0)
    raised = Failed({1: RankFailure(1, "ValueError", "bad")}, 1)

    def starts(*outcomes):
        tried = []

        def attempt():
            tried.append(1)
            return outcomes[min(len(tried), len(outcomes)) - 1]

        return attempt, tried

    attempt, tried = starts(unformed, Finished([b"ok"]))
    assert until_formed(attempt) == Finished([b"ok"]) and len(tried) == 2
    attempt, tried = starts(unformed)  # never forms: reported after REGROUPS more tries
    assert until_formed(attempt) is unformed and len(tried) == REGROUPS + 1
    attempt, tried = starts(raised)  # user code ran: no second try here
    assert until_formed(attempt) is raised and len(tried) == 1
    attempt, tried = starts(unformed, None)  # a pool's generation: None once it is up
    assert until_formed(attempt) is None and len(tried) == 2
