"""The reference documents' samples, as written, in a real kernel on 2 CPU ranks.

The resume loop runs twice: the second run restores the newest step, starts
again at that step (as the sample is written), saves it again, and trains on.
Each run goes past one epoch, and a new epoch's iterator starts while an async
save is in flight.
"""

from __future__ import annotations

import pytest
from _reference_cells import CELLS
from _user_code_nb import NotebookKernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    volume = tmp_path_factory.mktemp("volume")
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        nb.run(
            f"import os; os.environ['VOLUME'] = {str(volume)!r}\n"
            f"os.environ['NBTOOLS_CACHE_DIR'] = {str(volume / 'cache')!r}"
        )
        for name in ("setup", "dataset", "train"):
            nb.run(CELLS[name])
        yield nb


@pytest.mark.slow
def test_the_resume_loop_runs_twice_and_the_second_run_trains_on(kernel):
    kernel.run("first = train.distributed(9)")
    first = kernel.eval("first")
    assert [r["start"] for r in first] == [0, 0]
    assert first[0]["saved"] == [0, 4, 8]
    # Epochs of 5 steps: the second epoch's iterator starts while step 4's async save
    # is in flight (a deadlock when the data layer's collectives shared its group).
    assert [r["epochs"] for r in first] == [2, 2]
    second = kernel.eval("train.distributed(14)")
    # Restored step_8, started at 8 (as written), saved step 8 again and went on.
    assert [r["start"] for r in second] == [8, 8]
    assert second[0]["steps"] == list(range(8, 14)) and second[0]["saved"] == [8, 12]
    assert [r["epochs"] for r in second] == [2, 2]  # step 13 starts an epoch after saving 12
    assert second[0]["weight"] != first[0]["weight"]
    assert kernel.eval("sorted(os.listdir(f'{VOLUME}/checkpoints'))") == [
        "step_0",
        "step_12",
        "step_4",
        "step_8",
    ]


def test_the_rng_sample_restores_every_stream(kernel):
    assert kernel.eval(CELLS["rng"]) is True
