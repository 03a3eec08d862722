"""nbtools logs from rank 0 only, whichever nbtools logger a record comes from (real ranks)."""

from __future__ import annotations

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
