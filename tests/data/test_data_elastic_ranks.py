"""A fixed global batch through launches at changing world sizes: real gloo ranks with DDP.

A job that loses ranks goes on at a smaller world size from its checkpoint, and
grows back later: here each world size is a separate launch, with the model and
the loader's state carried across through a ``CheckpointManager`` (or files). Every step takes the global batch,
every sample of the epoch comes exactly once, and the gradients are those of
one process on the same global batches.

Tolerance: the model is float64; DDP sums each rank's partial sums, one process
sums all samples at once, so only the order of the additions differs: a
relative error of a few ulps per addition over at most a few dozen samples,
far below ``rtol=1e-9``.
"""

from __future__ import annotations

import pytest
import torch
from _elastic_ranks import SEED, Samples, global_steps, launch, ledger, make_tree, reference

from nbtools.data import DataLoader, VolumeDataset


def _single_process_steps(root, global_batch: int) -> list[list[int]]:
    """The global batches of one uninterrupted process (world size 1)."""
    files = VolumeDataset(root / "src", cache_dir=root / "cache", shuffle=True, seed=SEED)
    with DataLoader(Samples(files), global_batch_size=global_batch, num_workers=0) as loader:
        return [b.tolist() for b in loader]


def steps_left(ranks_by_phase, ranks) -> int:
    """Launches after the one that gave ``ranks``."""
    return len(ranks_by_phase) - 1 - ranks_by_phase.index(ranks)


def _run(root, n: int, global_batch: int, phases, checkpoint: bool = False) -> None:
    make_tree(root / "src", n)
    ranks_by_phase = [
        launch(root, world, workers, steps, global_batch, f"p{i}", checkpoint=checkpoint)
        for i, (world, workers, steps) in enumerate(phases)
    ]
    steps = [s for ranks in ranks_by_phase for s in global_steps(ranks)]
    # Each rank took its share, the first global_batch % world ranks one more, in every
    # step but the epoch's last.
    for (world, _, _), ranks in zip(phases, ranks_by_phase, strict=True):
        base, extra = divmod(global_batch, world)
        for r, rank in enumerate(ranks):
            sizes = [len(s) for s in rank["steps"]]
            if steps_left(ranks_by_phase, ranks) == 0 and n % global_batch:
                sizes = sizes[:-1]
            assert set(sizes) == {base + (r < extra)}
    whole, rest = divmod(n, global_batch)
    assert [len(s) for s in steps] == [global_batch] * whole + ([rest] if rest else [])
    assert ledger([i for s in steps for i in s], n) == {"duplicates": 0, "drops": 0}
    # The same global batches, in the same order, as one process that never stopped.
    assert [sorted(s) for s in steps] == [
        sorted(s) for s in _single_process_steps(root, global_batch)
    ]
    grads, model = reference(steps)
    got = [g for ranks in ranks_by_phase for g in ranks[0]["grads"]]
    assert len(got) == len(grads)
    for mine, theirs in zip(got, grads, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-9, atol=1e-12)
    final = torch.load(root / "params.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_four_then_three_then_four_ranks_keep_the_global_batch_and_see_each_sample_once(tmp_path):
    # 40 samples, global batch 7: five whole steps and a last one of 5; 7 = 2+2+2+1 on
    # four ranks, 3+2+2 on three. The second launch reads with a loader worker per rank. The
    # model and the loader's position go from launch to launch through CheckpointManager, as
    # the next attempt of a job that lost ranks restores them.
    _run(tmp_path, 40, 7, [(4, 0, 2), (3, 1, 2), (4, 0, None)], checkpoint=True)


@pytest.mark.slow
def test_eight_then_five_then_eight_ranks_keep_the_global_batch_and_see_each_sample_once(
    tmp_path,
):
    # 103 samples, global batch 13: seven whole steps and a last one of 12.
    _run(tmp_path, 103, 13, [(8, 0, 3), (5, 2, 2), (8, 1, None)])
