"""nbtools logs from rank 0 only, whichever nbtools logger a record comes from (real ranks)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nbtools import distributed


@pytest.mark.slow
def test_only_rank_zero_reaches_the_root_handler_from_every_nbtools_logger(monkeypatch):
    monkeypatch.delenv("NBTOOLS_LOG_ALL_RANKS", raising=False)

    @distributed(processes=2)
    def warn_from_nbtools_loggers() -> list[str]:
        # Defined here, as in a notebook cell: what a user's logging.basicConfig() sees.
        import logging

        from nbtools._internal.log import get_logger

        seen: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(f"{record.name}: {record.getMessage()}")

        logging.basicConfig()
        logging.getLogger().addHandler(Keep())
        get_logger("checkpoint").warning("from a subpackage")
        get_logger("data.cache").warning("from a nested one")
        get_logger().warning("from the package logger")
        return seen

    rank0, rank1 = warn_from_nbtools_loggers.distributed()
    assert rank0 == [
        "nbtools.checkpoint: from a subpackage",
        "nbtools.data.cache: from a nested one",
        "nbtools: from the package logger",
    ]
    assert rank1 == []


@pytest.mark.slow
def test_the_first_other_rank_that_starts_a_run_says_once_what_it_records(client, capfd):
    @distributed(processes=3)
    def fit(start: bool) -> str | None:
        import mlflow

        if not start:
            return None  # mlflow imported, no run started
        for _ in range(2):
            with mlflow.start_run(run_name="fit") as run:
                mlflow.log_metric("loss", 0.5)
        return run.info.run_id

    assert fit.distributed(False) == [None, None, None]
    assert "records nothing" not in capfd.readouterr().err
    ids = fit.distributed(True)
    err = capfd.readouterr().err
    notice = "rank 0 records the runs. On ranks 1-2, mlflow.start_run() returns a run that"
    assert err.count(notice) == 1, err
    assert ids[1:] == ["rank1-not-recorded", "rank2-not-recorded"], ids
    runs = client.search_runs([client.get_run(ids[0]).info.experiment_id])
    assert [r.info.run_name for r in runs].count("fit") == 2  # rank 0's two runs, no others


def test_a_level_the_settings_refuse_keeps_the_default_and_says_so_once():
    code = (
        "from nbtools._internal.log import get_logger\n"
        "get_logger('data').info('quiet at WARNING')\n"
        "get_logger('checkpoint').warning('shown')\n"
    )
    env = {**os.environ, "NBTOOLS_LOG_LEVEL": "loud"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "nbtools: WARNING: NBTOOLS_LOG_LEVEL='loud' is not a valid level name: must be DEBUG, "
        "INFO, WARNING, ERROR or CRITICAL; unset it for the default (WARNING); using the default",
        "nbtools: WARNING: shown",
    ]
